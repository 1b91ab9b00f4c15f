# image: ghcr.io/gpu-coloc/coloc-agent
# The node agent, with the CUDA shim its pods' init container installs on the node, and
# the shim's SHA-256 digest taken here (libcoloc_cuda.so.sha256), which that init container
# checks before installing it and again on the node after (coloc-node-setup --sha256).
# Multi-stage; amd64 and arm64 (docker buildx build --platform linux/amd64,linux/arm64 -f
# deploy/docker/agent.Dockerfile .): each image is built natively for its TARGETARCH
# (under emulation when it is not the builder's).
#
# BINARIES and RUNTIME_BASE let a build skip the Rust stage: with
#   --build-arg BINARIES=<an image holding /out as the build stage makes it>
#   --build-arg RUNTIME_BASE=<a glibc base>
# the runtime stage is assembled from binaries built on the host (the deploy checks build
# it that way with buildah, without a daemon or a registry: deploy/scripts/check-deploy.py).
ARG RUST_VERSION=1.95
ARG BINARIES=build
ARG RUNTIME_BASE=gcr.io/distroless/cc-debian12
FROM docker.io/library/rust:${RUST_VERSION}-bookworm AS build
ARG TARGETARCH
WORKDIR /src
# The whole workspace (.dockerignore leaves out target/ and .git): Cargo needs every member.
COPY . .
# The shim is preloaded into the images users already run, many with a glibc older than
# this stage's: it is built by Zig against glibc 2.17 (cargo-zigbuild), and its need of the
# loader by name is removed so that musl's loader loads it too (scripts/build-compat does
# the same; tests/compat checks the floor and runs it in Debian 11's userland).
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq patchelf python3-pip >/dev/null \
 && pip3 install -q --break-system-packages ziglang==0.17.1 cargo-zigbuild==0.24.1
RUN echo "building coloc-agent for ${TARGETARCH}" \
 && arch="$(uname -m)" \
 && cargo build --release --locked --bin coloc-agent --bin coloc-node-setup \
 && cargo zigbuild --release --locked -p coloc-cuda-shim --lib --target "${arch}-unknown-linux-gnu.2.17" \
 && shim="target/${arch}-unknown-linux-gnu/release/libcoloc_cuda.so" \
 && patchelf --remove-needed "$(patchelf --print-needed "$shim" | grep '^ld-linux')" "$shim" \
 && install -D target/release/coloc-agent /out/usr/local/bin/coloc-agent \
 && install -D target/release/coloc-node-setup /out/usr/local/bin/coloc-node-setup \
 && install -D -m 0444 "$shim" /out/opt/coloc/lib/libcoloc_cuda.so \
 && cd /out/opt/coloc/lib && sha256sum libcoloc_cuda.so > libcoloc_cuda.so.sha256

FROM ${BINARIES} AS binaries

# glibc (NVML is loaded with dlopen; the shim is a glibc library), nothing else; the agent
# runs as root by design (see the README's privileges table), without a shell.
FROM ${RUNTIME_BASE}
COPY --from=binaries /out/ /
ENTRYPOINT ["/usr/local/bin/coloc-agent"]
CMD ["run"]
