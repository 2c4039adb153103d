# syntax=docker/dockerfile:1
# Rimuru on a CUDA 12.8 runtime, serving on port 8000:
#
#   docker build -t rimuru .
#   docker run --gpus all --ipc=host -p 8000:8000 -v ~/.cache/huggingface:/data/hf \
#       rimuru Qwen/Qwen3-30B-A3B --gpu-memory-budget 30GiB
#
# Two stages: the builder turns the source tree into a wheel; the final stage installs only that wheel (with the
# `serve` extra) on top of the CUDA build of torch. tests/packaging/ lints this file with hadolint and builds the same
# wheel from the same files, installs it into a fresh virtual environment and runs it; no Docker engine runs in CI.

FROM python:3.12.11-slim-bookworm AS builder
WORKDIR /src
COPY pyproject.toml README.md ./
COPY rimuru/ rimuru/
COPY ops/ ops/
COPY models/ models/
COPY serving/ serving/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .


FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04

# Triton compiles a small launcher with the C compiler at run time, against Python's headers: hence gcc and
# python3-dev in a runtime image. The base tag pins the Ubuntu release; Ubuntu drops superseded package versions
# from its archive, so exact apt pins would break the build within weeks.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# Numeric uid 1000, the usual owner of a host's ~/.cache/huggingface, so a bind-mounted cache stays writable.
# Ubuntu's image already gives uid 1000 to `ubuntu`; that account goes. The cache folders are sticky and open to all
# (as /tmp is) so that `docker run --user "$(id -u):$(id -g)"` works for a host uid other than 1000.
RUN (userdel --remove ubuntu 2>/dev/null || true) \
    && useradd --uid 1000 --user-group --create-home --home-dir /home/rimuru --shell /usr/sbin/nologin rimuru \
    && mkdir -p /data/hf /data/triton /data/inductor \
    && chown -R 1000:1000 /data \
    && chmod 1777 /data/hf /data/triton /data/inductor

ENV VIRTUAL_ENV=/opt/rimuru \
    PATH=/opt/rimuru/bin:$PATH \
    HOME=/home/rimuru \
    HF_HOME=/data/hf \
    TRITON_CACHE_DIR=/data/triton \
    TORCHINDUCTOR_CACHE_DIR=/data/inductor \
    PYTHONUNBUFFERED=1

# torch first, from PyTorch's CUDA 12.8 index, in its own layer: it is most of the image and changes least.
RUN python3 -m venv /opt/rimuru \
    && pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cu128 torch==2.11.0

# The wheel is mounted from the builder, never copied into a layer.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    set -- /wheels/rimuru-*.whl \
    && pip install --no-cache-dir "rimuru[serve,linear-attention] @ file://$1" \
    && rimuru --help >/dev/null

USER 1000:1000
WORKDIR /home/rimuru
VOLUME ["/data/hf", "/data/triton", "/data/inductor"]
EXPOSE 8000

# Exec form: `rimuru` is PID 1 and receives SIGTERM itself, so `docker stop` drains requests in flight (give it
# `--stop-timeout` above the server's `--shutdown-timeout`, 30 s by default). `--host 0.0.0.0` sits in the
# entrypoint, not in CMD, because `docker run IMAGE MODEL FLAGS` replaces CMD whole; a later `--host` still wins.
ENTRYPOINT ["rimuru", "serve", "--host", "0.0.0.0"]
CMD []

# The start period covers downloading and loading weights. It probes the default port: with `--port` override it
# with `docker run --health-cmd`. No curl in the image, so Python asks; a 503 (draining) raises, as does no answer.
HEALTHCHECK --interval=30s --timeout=10s --start-period=10m --retries=3 \
    CMD ["/opt/rimuru/bin/python", "-c", \
         "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=5)"]
