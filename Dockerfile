# The training image of cluster=kubernetes (docs/kubernetes.md): exactly the hash-checked runtime lock of the CUDA
# build (what running needs; its -dev lock, with the test tools, stays out), then this package, at /app (configs
# are read from there). Make the locks first, once (README, Install):
#   make lock LOCK=requirements-cu128.lock TORCH=torch==2.13.0+cu128 TORCH_INDEX=https://download.pytorch.org/whl/cu128
#   docker build -t <registry>/mlproject:<tag> . && docker push <registry>/mlproject:<tag>
# torch's CUDA wheels bring the CUDA libraries; the GPU driver comes from the node (NVIDIA container toolkit).
# The Python version must be the lock's (it is made for one): 3.11.
FROM python:3.11-slim-bookworm

ARG LOCK=requirements-cu128.lock
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PROJECT_ROOT=/app
WORKDIR /app

# Dependencies first, in their own layer: rebuilt only when the lock changes.
COPY ${LOCK} /tmp/requirements.lock
RUN python -m venv "$VIRTUAL_ENV" \
    && pip install --require-hashes --no-deps -r /tmp/requirements.lock \
    && rm /tmp/requirements.lock

# Editable, as `make install` does: the package finds configs/ beside src/ (core/constants.py).
COPY pyproject.toml README.md ./
COPY src ./src
COPY configs ./configs
RUN pip install --no-deps -e .

# The TrainJob's command runs `python -m torch.distributed.run ... -m mlproject.train`; this is for `docker run`.
CMD ["python", "-m", "mlproject.train", "--help"]
