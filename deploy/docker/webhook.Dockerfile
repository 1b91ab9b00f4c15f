# image: ghcr.io/gpu-coloc/coloc-webhook
# The admission webhook (and its certificate bootstrap Job). Multi-stage; amd64 and arm64
# (docker buildx build --platform linux/amd64,linux/arm64 -f deploy/docker/webhook.Dockerfile .).
ARG RUST_VERSION=1.95
FROM docker.io/library/rust:${RUST_VERSION}-bookworm AS build
ARG TARGETARCH
WORKDIR /src
# The whole workspace (.dockerignore leaves out target/ and .git): Cargo needs every member.
COPY . .
RUN echo "building coloc-webhook for ${TARGETARCH}" \
 && cargo build --release --locked --bin coloc-webhook \
 && install -D target/release/coloc-webhook /out/usr/local/bin/coloc-webhook

# No shell, no package manager; a non-root user (the chart's runAsUser).
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/ /
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/coloc-webhook"]
