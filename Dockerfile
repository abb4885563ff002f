# Image for the multi-node demo (docker-compose.yml): one container per worker.
#
#   docker compose up --build                   # on a machine that reaches Docker Hub and PyPI
#   python3 dev.py compose                      # builds it as below, then runs the cluster
#
# BASE: any image with Python 3.11 and venv (tools/compose.py makes one with debootstrap where
# Docker Hub cannot be reached). TORCH: what pip installs torch from (a requirement, a URL).
# docker/build-extras/ may hold a torch wheel (found before PyPI) and a CA bundle (PIP_CA:
# where the registry's TLS is intercepted).
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG TORCH=torch==2.13.0
ARG PIP_CA=
ENV PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv
COPY docker/build-extras /tmp/build-extras
RUN if [ -n "$PIP_CA" ]; then export PIP_CERT="$PIP_CA"; fi; \
    pip install --find-links /tmp/build-extras "$TORCH"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY transport transport
COPY zmqautograd zmqautograd
COPY tools tools
RUN if [ -n "$PIP_CA" ]; then export PIP_CERT="$PIP_CA"; fi; \
    pip install . && rm -rf /tmp/build-extras
CMD ["python", "tools/demo.py"]
