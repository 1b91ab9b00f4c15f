# image: ghcr.io/gpu-coloc/coloc-agent
# The node agent. Multi-stage; amd64 and arm64 (docker buildx build --platform
# linux/amd64,linux/arm64 -f deploy/docker/agent.Dockerfile .): each image is built
# natively for its TARGETARCH (under emulation when it is not the builder's).
ARG RUST_VERSION=1.95
FROM docker.io/library/rust:${RUST_VERSION}-bookworm AS build
ARG TARGETARCH
WORKDIR /src
# The whole workspace (.dockerignore leaves out target/ and .git): Cargo needs every member.
COPY . .
RUN cargo build --release --locked --bin coloc-agent \
 && install -D target/release/coloc-agent /out/usr/local/bin/coloc-agent
# With agent.runtimeClassName="" the chart mounts the host's /usr/lib at /host/usr/lib:
# this link points into the multiarch directory of the image's own architecture.
RUN case "${TARGETARCH}" in \
      amd64) dir=x86_64-linux-gnu ;; \
      arm64) dir=aarch64-linux-gnu ;; \
      *) echo "unsupported TARGETARCH ${TARGETARCH}" >&2; exit 1 ;; \
    esac \
 && mkdir -p /out/opt/coloc/host-nvml \
 && ln -s "/host/usr/lib/${dir}/libnvidia-ml.so.1" /out/opt/coloc/host-nvml/libnvidia-ml.so.1

# glibc (NVML is loaded with dlopen), nothing else; the agent runs as root by design
# (see the README's privileges table), without a shell.
FROM gcr.io/distroless/cc-debian12
COPY --from=build /out/ /
ENTRYPOINT ["/usr/local/bin/coloc-agent"]
CMD ["run"]
