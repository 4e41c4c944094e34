# omni-watchdog: the sidecar image.
#
# Stage "build" turns the source into wheels (the package and every dependency, py-spy's
# binary wheel included); stage "runtime" installs them offline into a slim Python with no
# compiler, no pip cache and no source tree. See "Deployment" in README.md for the
# capabilities the container needs and what works without each.
ARG PYTHON_VERSION=3.12

FROM python:${PYTHON_VERSION}-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY omni_watchdog ./omni_watchdog
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:${PYTHON_VERSION}-slim AS runtime
# Copied rather than bind-mounted from the build stage (~9 MB stay in this layer): podman
# 4.3's buildah cannot mount from another stage.
COPY --from=build /wheels /wheels
# A copy of py-spy, py-spy-ptrace, carries file capability cap_sys_ptrace so that it can
# read another user's process memory when the container is granted SYS_PTRACE (added
# capabilities never reach a non-root user's processes otherwise). Without SYS_PTRACE the
# kernel refuses to start that copy at all, so plain py-spy stays beside it and the
# watchdog picks the one its bounding set allows. libcap2-bin is only needed to set it.
RUN pip install --no-cache-dir --no-index --find-links /wheels omni-watchdog \
    && rm -rf /wheels \
    && cp "$(command -v py-spy)" /usr/local/bin/py-spy-ptrace \
    && apt-get update \
    && apt-get install -y --no-install-recommends libcap2-bin \
    && setcap cap_sys_ptrace+ep /usr/local/bin/py-spy-ptrace \
    && apt-get purge -y --auto-remove libcap2-bin \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --user-group --no-create-home --home-dir /var/lib/omni-watchdog \
        --shell /usr/sbin/nologin watchdog \
    && install -d -o 10001 -g 10001 /var/lib/omni-watchdog

# Every setting is an OMNI_WATCHDOG_* variable (`omni-watchdog config --defaults`); these
# make the defaults fit a container: the API listens beyond loopback for probes and
# scrapes, state is kept in a volume. The OTLP receiver stays on loopback, where the
# server reaches it in a shared network namespace (a pod, or compose's network_mode
# service:); any other address also needs OMNI_WATCHDOG_OTLP_TOKEN.
ENV OMNI_WATCHDOG_LISTEN=0.0.0.0:9464 \
    OMNI_WATCHDOG_SPANS_OTLP_LISTEN=127.0.0.1:4318 \
    OMNI_WATCHDOG_STATE_DIR=/var/lib/omni-watchdog \
    OMNI_WATCHDOG_TARGET=http://127.0.0.1:8000 \
    PYTHONUNBUFFERED=1

# A numeric user, so that Kubernetes' runAsNonRoot can check it.
USER 10001
WORKDIR /var/lib/omni-watchdog
VOLUME ["/var/lib/omni-watchdog"]
EXPOSE 9464

# The watchdog's own health on the port OMNI_WATCHDOG_LISTEN names.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; port = os.environ.get('OMNI_WATCHDOG_LISTEN', ':9464').rpartition(':')[2]; urllib.request.urlopen(f'http://127.0.0.1:{port}/healthz', timeout=2)"]

ENTRYPOINT ["omni-watchdog"]
CMD ["run"]
