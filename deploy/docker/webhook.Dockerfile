# image: ghcr.io/gpu-coloc/coloc-webhook
# The admission webhook (and its certificate bootstrap Jobs). The build stage is agent.Dockerfile's,
# line for line, so that a build of both images compiles once.
#
# Multi-arch without emulation: the build stage runs on the builder's own platform
# (BUILDPLATFORM) and cross-compiles for TARGETARCH with cargo-zigbuild against glibc 2.17
# (scripts/build-release: binaries stripped, debug info split beside them; the release
# workflow publishes those files). The runtime stage only copies files, so
#   docker buildx build --platform linux/amd64,linux/arm64 -f deploy/docker/webhook.Dockerfile .
# runs no foreign-architecture binary.
#
# BINARIES and RUNTIME_BASE let a build skip the Rust stage:
#   --build-arg BINARIES=prebuilt         the files scripts/build-release left in
#                                         dist/<TARGETARCH>/out (what the release workflow does)
#   --build-arg BINARIES=<an image holding /out as the build stage makes it>
#   --build-arg RUNTIME_BASE=<a glibc base>
# (the deploy checks build it with buildah that way, without a daemon or a registry:
# deploy/scripts/check-deploy.py).
ARG RUST_VERSION=1.95
ARG BINARIES=build
ARG RUNTIME_BASE=gcr.io/distroless/cc-debian12:nonroot
FROM --platform=$BUILDPLATFORM docker.io/library/rust:${RUST_VERSION}-bookworm AS build
ARG TARGETARCH
WORKDIR /src
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq patchelf python3-pip binutils-aarch64-linux-gnu >/dev/null \
 && pip3 install -q --break-system-packages ziglang==0.17.1 cargo-zigbuild==0.24.1 \
 && rustup target add x86_64-unknown-linux-gnu aarch64-unknown-linux-gnu
# The whole workspace (.dockerignore leaves out target/ and .git): Cargo needs every member.
COPY . .
RUN echo "building gpu-coloc for ${TARGETARCH}" && scripts/build-release "${TARGETARCH}" /dist && mv /dist/out /out

FROM scratch AS prebuilt
ARG TARGETARCH
COPY dist/${TARGETARCH}/out/ /out/

FROM ${BINARIES} AS binaries

# No shell, no package manager; a non-root user (the chart's runAsUser).
FROM ${RUNTIME_BASE}
COPY --from=binaries /out/usr/local/bin/coloc-webhook /usr/local/bin/
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/coloc-webhook"]
