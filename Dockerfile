# The shoal image the Kubernetes manifests run (deploy/kubernetes/README.md):
#   docker build -t shoal:0.1.0 .
# One image for every component (`shoal worker`, `shoal combiner`, `shoal scaler`, gateways,
# `shoal tail`...); the broker runs the eclipse-mosquitto image. Non-root, nothing written
# outside mounted volumes, so pods can use readOnlyRootFilesystem.

FROM python:3.11-slim AS build
WORKDIR /src
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# The wheel carries broker/, processors/, schemas/ and loadtest/ (pyproject.toml).
COPY pyproject.toml README.md ./
COPY src ./src
COPY broker ./broker
COPY processors ./processors
COPY schemas ./schemas
COPY loadtest ./loadtest
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=build /wheels /wheels
# Extras: kubernetes (the official client, for `shoal scaler --backend kubernetes`) and
# sinks (psycopg, for `shoal sink postgres`).
RUN pip install "$(ls /wheels/shoal-*.whl)[kubernetes,sinks]" && rm -rf /wheels \
    && useradd --system --uid 10001 --user-group --no-create-home --home-dir /nonexistent shoal
USER 10001:10001
WORKDIR /tmp
ENTRYPOINT ["shoal"]
CMD ["--help"]
