# hamipy-monitor: per-container GPU metrics on every GPU node. Build from the repository root:
#   docker build -f deploy/docker/monitor.Dockerfile -t hami-py/monitor:0.1.0 .
# It runs as root: it reads and writes (priority feedback) the region files that containers of any
# user create under the host's hook path, and loads the host's NVML.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy UV_PYTHON_DOWNLOADS=never UV_PROJECT_ENVIRONMENT=/opt/hamipy
RUN pip install --no-cache-dir uv==0.13.9
WORKDIR /src
COPY pyproject.toml uv.lock ./
COPY libs/ libs/
COPY services/ services/
RUN uv sync --frozen --no-dev --no-editable --package hamipy-monitor

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/hamipy /opt/hamipy
ENV PATH=/opt/hamipy/bin:$PATH PYTHONUNBUFFERED=1
EXPOSE 9394
ENTRYPOINT ["hamipy-monitor"]
