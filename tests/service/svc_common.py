"""Helpers shared by the service tests that drive a live gpupoold (test_ctl.py, test_ops.py):
failing with a message, waiting for a service-manager notification, reading a socket to its
end."""
import socket
import sys
import time


def fail(msg):
    print("FAIL: " + msg, file=sys.stderr)
    raise SystemExit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


def recv_notify(sock, want, timeout):
    """The first datagram on sock (a stand-in NOTIFY_SOCKET) that contains want, or None
    when none came within timeout seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        sock.settimeout(max(0.01, end - time.monotonic()))
        try:
            msg = sock.recv(4096).decode()
        except socket.timeout:
            break
        if want in msg:
            return msg
    return None


def read_to_end(s):
    """Everything s sends until it closes, decoded."""
    data = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            return data.decode()
        data += chunk
