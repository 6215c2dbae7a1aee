"""The pod behind the proxy tests and ``bench/proxy.py``: busybox only, an ``httpd`` on
port 8080 and a WebSocket echo server (``ws_echo.sh``, an ash script) on port 8765."""

from __future__ import annotations

from pathlib import Path

from gpucloud.images.testing import BuiltImage, busybox_image, directory, file

HTTP_PORT = 8080
WS_PORT = 8765
INDEX = "<h1>hello from the pod</h1>\n"
COMMAND = ["sh", "-c", f"httpd -p {HTTP_PORT} -h /www; "
                       f"exec nc -ll -p {WS_PORT} -e /ws_echo.sh"]
PORTS = [f"{HTTP_PORT}/http", f"{WS_PORT}/http"]


def proxy_pod_image() -> BuiltImage:
    script = (Path(__file__).parent / "ws_echo.sh").read_text()
    return busybox_image(extra_files={
        "www": directory(), "www/index.html": file(INDEX),
        "ws_echo.sh": file(script, 0o755)})
