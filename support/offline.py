"""The offline probe, torch-free: whether the environment says offline, and whether a host
answers, said at once, where the Hub and HTTP clients retry for half a minute and then say nothing
about offline use."""

import os
import socket
import threading
import urllib.parse
import urllib.request

from support.cli import first_line


def hub_offline(variables):
    """(the Hub's address: HF_ENDPOINT, else huggingface.co; why it cannot be asked now, or None):
    the first of variables set to a true value, as huggingface_hub reads them, else unreachable's."""
    hub = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    var = next((v for v in variables if os.environ.get(v, "").strip().upper() in ("1", "ON", "YES", "TRUE")), None)
    return hub, f"{var} is set" if var else unreachable(hub)


def unreachable(url, timeout=3.0):
    """Why no TCP connection to url's host opens within timeout seconds, in words, or None. Offline,
    the Hub and HTTP clients retry for half a minute and then say nothing about offline use; this
    says it at once. With an https proxy set, the proxy is what must answer."""
    proxy = urllib.request.getproxies().get("https")
    parts = urllib.parse.urlsplit(proxy or url)
    host, port = parts.hostname or "", parts.port or (80 if parts.scheme == "http" else 443)
    outcome = []

    def probe():  # in a thread: a resolver that never answers must not hold the program either
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome.append(None)
        except OSError as e:
            outcome.append(e)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    if not outcome:
        return f"no answer in {timeout:.0f} s"
    return None if outcome[0] is None else first_line(outcome[0])
