"""Does a gRPC server answer at an address? Pure Python (no TensorFlow), so a
process whose TensorFlow is blocked, or one that never loads it (the
supervisor of a `launch.train` worker), can tell a gone or frozen peer.
"""

import socket
import threading
import time

# RFC 9113 section 3.4: the client's connection preface, then its (empty)
# SETTINGS frame. A live HTTP/2 server (gRPC) must answer with a SETTINGS frame.
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
_SETTINGS = 0x4  # frame type, byte 3 of the 9-byte frame header


def probe_task(address, timeout_s=2.0):
    """Whether the gRPC server at `address` ("host:port") answers now.

    Returns:
      "ok": it sent an HTTP/2 SETTINGS frame within `timeout_s` seconds;
      "silent": the connection was accepted (by the kernel) but nothing came
        back in time: the process is stopped or its host hung;
      "dead": the connection was refused or failed: nothing listens there.
    """
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    except socket.timeout:
        return "silent"  # a partitioned host: the SYN is never answered
    except OSError:
        return "dead"
    with sock:
        try:
            sock.sendall(_PREFACE)
            header = b""
            while len(header) < 9:
                left = deadline - time.monotonic()
                if left <= 0:
                    return "silent"
                sock.settimeout(left)
                chunk = sock.recv(9 - len(header))
                if not chunk:
                    return "dead"  # closed without a frame
                header += chunk
        except socket.timeout:
            return "silent"
        except OSError:
            return "dead"
    return "ok" if header[3] == _SETTINGS else "dead"


def probe_tasks(addresses, timeout_s=2.0):
    """{task: probe_task(address)} for {task: address}, probed in parallel
    (the whole probe takes at most `timeout_s` + a thread start)."""
    states = {}

    def run(task, address):
        states[task] = probe_task(address, timeout_s)

    threads = [threading.Thread(target=run, args=item, daemon=True) for item in addresses.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 5.0)
    return {task: states.get(task, "silent") for task in addresses}


# What a probe's answer means, as the messages say it.
MEANING = {"silent": "accepts connections but does not answer: the process is stopped "
                      "or its host is hung",
            "dead": "refuses connections: the process is gone"}
