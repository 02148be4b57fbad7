# etcd for the compose cluster, from Debian's package on duet's own base image (nothing pulled).
ARG BASE_IMAGE=duet-base:bookworm-2
FROM ${BASE_IMAGE}
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends etcd-server etcd-client \
 && rm -rf /var/lib/apt/lists/*
USER 65532:65532
WORKDIR /tmp
ENTRYPOINT ["/usr/bin/etcd"]
