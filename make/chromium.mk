# Chromium renders the HTML incident report in the browser test: the timeline's SVG must
# lay out with a visible bar per ladder step. It comes from Debian's `chromium` package
# (CI runs as root on Debian with only the package registries reachable).
.PHONY: chromium-tools

tools: chromium-tools

chromium-tools:
	@if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then \
		if [ "$$(id -u)" -ne 0 ]; then \
			echo "chromium missing: run 'make tools' as root or install Debian's chromium package" >&2; \
			exit 1; \
		fi; \
		apt-get update && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium; \
	fi
	@$$(command -v chromium || command -v chromium-browser) --version | head -n 1
