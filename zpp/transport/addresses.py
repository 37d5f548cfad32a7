"""Which address and network interface each process of a multi-host run uses.

The head (the engine's host) listens on one address that every other host can reach:
``--distributed-host`` if given, else ``$ZPP_HOST_IP`` (like vLLM's ``VLLM_HOST_IP``), else the
source address of the route this host would use to reach the first remote host (the kernel's
routing decision, read with a connected UDP socket: no packet is sent). Each worker then finds the
address of its own interface that reaches the head the same way, and tells gloo / NCCL to use that
interface (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``) unless the user set them: left alone,
gloo announces whatever the host name resolves to, often a loopback address, and the other host
then dials itself.
"""
from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
from typing import Optional, Sequence

from zpp import envs
from zpp.errors import ConfigError

logger = logging.getLogger(__name__)

_SIOCGIFADDR = 0x8915


def host_of(node: str) -> str:
    """The host part of a ``--nodes`` entry: ``user@host:N`` -> ``host`` (``[v6]`` unbracketed)."""
    host = node.rsplit("@", 1)[-1]
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host


def route_source_address(dest: str) -> str:
    """This host's source address on the route to ``dest`` (a host name or address).

    Raises:
        OSError: ``dest`` does not resolve, or no route leads to it.
    """
    family, _, _, _, sockaddr = socket.getaddrinfo(dest, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)  # UDP connect: picks the route, sends nothing
        return s.getsockname()[0]


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def interface_of(address: str) -> Optional[str]:
    """Name of the local network interface that holds ``address`` (IPv4 or IPv6), or None."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    if ip.version == 6:
        try:
            with open("/proc/net/if_inet6") as f:
                for line in f:
                    parts = line.split()
                    if len(parts) >= 6 and ipaddress.ip_address(int(parts[0], 16)) == ip:
                        return parts[5]
        except OSError:
            pass
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # interface without an IPv4 address
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def choose_head_address(nodes: Sequence[str], distributed_host: Optional[str]) -> str:
    """The address the head binds its control plane and rendezvous store to in a multi-host run.

    Raises:
        ConfigError: the address cannot be found, or it is a loopback address while some node is
            another host (workers there could never reach it).
    """
    source = "--distributed-host"
    address = distributed_host or envs.ZPP_HOST_IP
    if address is None:
        source = f"the route to {host_of(nodes[0])}"
        try:
            address = route_source_address(host_of(nodes[0]))
        except OSError as e:
            raise ConfigError(f"--nodes {nodes[0]}: cannot find this host's address on the route to it "
                              f"({e.strerror or e}); give --distributed-host ADDRESS") from None
    elif not distributed_host:
        source = "ZPP_HOST_IP"
    remote = [n for n in nodes if not _resolves_to_loopback(host_of(n))]
    if is_loopback(address) and remote:
        raise ConfigError(f"{source} gives the loopback address {address}, which {host_of(remote[0])} cannot "
                          f"reach: give --distributed-host with an address of this host on the network the "
                          f"nodes share")
    return address


def _resolves_to_loopback(host: str) -> bool:
    try:
        return all(is_loopback(ai[4][0]) for ai in socket.getaddrinfo(host, None))
    except OSError:
        return False


def bind_interface_for(head_address: str) -> tuple[str, Optional[str]]:
    """This process's address that reaches ``head_address`` and its interface; point gloo and NCCL
    at that interface (unless ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` are set).

    Returns:
        (address, interface name or None when it cannot be found).
    Raises:
        OSError: no route to the head.
    """
    address = route_source_address(head_address)
    ifname = interface_of(address)
    if ifname is not None:
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(var, ifname)
    return address, ifname
