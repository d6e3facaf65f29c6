# hamipy-webhook: the admission webhook. Build from the repository root:
#   docker build -f deploy/docker/webhook.Dockerfile -t hami-py/webhook:0.1.0 .
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy UV_PYTHON_DOWNLOADS=never UV_PROJECT_ENVIRONMENT=/opt/hamipy
RUN pip install --no-cache-dir uv==0.13.9
WORKDIR /src
COPY pyproject.toml uv.lock ./
COPY libs/ libs/
COPY services/ services/
# Only this service and the libraries it depends on are installed (not editable, no dev tools).
RUN uv sync --frozen --no-dev --no-editable --package hamipy-webhook

FROM ${PYTHON_IMAGE}
RUN useradd --system --uid 65532 --no-create-home --shell /usr/sbin/nologin hamipy
COPY --from=build /opt/hamipy /opt/hamipy
ENV PATH=/opt/hamipy/bin:$PATH PYTHONUNBUFFERED=1
USER 65532
EXPOSE 9443 9090
ENTRYPOINT ["hamipy-webhook"]
CMD ["serve"]
