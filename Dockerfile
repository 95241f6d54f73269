# One image for every cohort process (gateway, batcher, worker, beat); the command picks the role.
# For GPU workers build on a CUDA base and install the CUDA torch wheel instead of the CPU one:
#   docker build --build-arg BASE=nvidia/cuda:12.4.1-runtime-ubuntu22.04 --build-arg TORCH_INDEX=cu124 .
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG TORCH_INDEX=cpu
ENV PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
RUN if ! command -v python3 >/dev/null; then apt-get update && apt-get install -y --no-install-recommends \
      python3 python3-pip python3-venv && rm -rf /var/lib/apt/lists/*; fi
WORKDIR /app
RUN python3 -m pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/${TORCH_INDEX}
COPY pyproject.toml README.md ./
COPY launch launch
COPY procstack procstack
COPY cohort cohort
COPY gateway gateway
COPY predictor predictor
COPY batcher batcher
COPY deployer deployer
COPY workers workers
COPY taskq taskq
COPY learning learning
COPY bench bench
RUN python3 -m pip install --no-cache-dir . flower
RUN useradd --create-home cohort && mkdir -p /app/var && chown cohort /app/var
USER cohort
EXPOSE 8000
CMD ["cohort", "gateway", "--host", "0.0.0.0"]
