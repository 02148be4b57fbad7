# Prometheus for the compose cluster, from Debian's package on duet's own base image (nothing
# pulled). Its configuration (prometheus.yml) and duet's rules (the chart's files/alerts.yml)
# are bind-mounted by compose.yaml.
ARG BASE_IMAGE=duet-base:bookworm-2
FROM ${BASE_IMAGE}
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus \
 && rm -rf /var/lib/apt/lists/* /usr/share/doc/*
USER 65532:65532
WORKDIR /tmp
ENTRYPOINT ["/usr/bin/prometheus"]
