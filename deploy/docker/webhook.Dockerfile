# image: ghcr.io/gpu-coloc/coloc-webhook
# The admission webhook (and its certificate bootstrap Jobs). Multi-stage; amd64 and arm64
# (docker buildx build --platform linux/amd64,linux/arm64 -f deploy/docker/webhook.Dockerfile .).
# BINARIES and RUNTIME_BASE: as in agent.Dockerfile (host-built binaries, a local base).
ARG RUST_VERSION=1.95
ARG BINARIES=build
ARG RUNTIME_BASE=gcr.io/distroless/cc-debian12:nonroot
FROM docker.io/library/rust:${RUST_VERSION}-bookworm AS build
ARG TARGETARCH
WORKDIR /src
# The whole workspace (.dockerignore leaves out target/ and .git): Cargo needs every member.
COPY . .
RUN echo "building coloc-webhook for ${TARGETARCH}" \
 && cargo build --release --locked --bin coloc-webhook \
 && install -D target/release/coloc-webhook /out/usr/local/bin/coloc-webhook

FROM ${BINARIES} AS binaries

# No shell, no package manager; a non-root user (the chart's runAsUser).
FROM ${RUNTIME_BASE}
COPY --from=binaries /out/ /
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/coloc-webhook"]
