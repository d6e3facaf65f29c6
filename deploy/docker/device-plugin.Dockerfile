# hamipy-device-plugin: GPU registration and Allocate on every GPU node, carrying libvgpu.so.
# Build from the repository root:
#   docker build -f deploy/docker/device-plugin.Dockerfile -t hami-py/device-plugin:0.1.0 .
# It runs as root: it serves a socket in the kubelet's device-plugin directory, writes the hook
# path on the host (libvgpu.so, ld.so.preload, containers' region directories) and loads NVML.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
# Any image with gcc, make and the C library headers (the official gcc image has them all).
ARG GCC_IMAGE=gcc:12.4.0-bookworm

FROM ${GCC_IMAGE} AS native
WORKDIR /src
COPY native/ native/
RUN make -C native build/libvgpu.so

FROM ${PYTHON_IMAGE} AS build
ENV UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy UV_PYTHON_DOWNLOADS=never UV_PROJECT_ENVIRONMENT=/opt/hamipy
RUN pip install --no-cache-dir uv==0.13.9
WORKDIR /src
COPY pyproject.toml uv.lock ./
COPY libs/ libs/
COPY services/ services/
RUN uv sync --frozen --no-dev --no-editable --package hamipy-device-plugin

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/hamipy /opt/hamipy
COPY --from=native /src/native/build/libvgpu.so /opt/hamipy/lib/libvgpu.so
ENV PATH=/opt/hamipy/bin:$PATH PYTHONUNBUFFERED=1
EXPOSE 9395
ENTRYPOINT ["hamipy-device-plugin", "--interposer", "/opt/hamipy/lib/libvgpu.so"]
