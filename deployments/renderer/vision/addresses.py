"""Which addresses an image URL may reach: public unicast ones only.

Refused: loopback, private (RFC 1918, unique local), link-local, multicast, reserved, unspecified, shared
(carrier-grade NAT) and the cloud metadata addresses; an IPv4-mapped IPv6 address is judged as its IPv4.
"""

import ipaddress

METADATA = (ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254"))


def refused_reason(address: str) -> str | None:
    """Why `address` may not be reached ("loopback", "private", ...), or None for a public address."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # a scoped IPv6 address's zone is not the address
    except ValueError:
        return "malformed"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    checks = (
        (ip in METADATA, "cloud metadata"),
        (ip.is_loopback, "loopback"),
        (ip.is_link_local, "link-local"),
        (ip.is_multicast, "multicast"),
        (ip.is_unspecified, "unspecified"),
        (ip.is_private, "private"),
        (ip.is_reserved, "reserved"),
        (not ip.is_global, "non-public"),
    )
    return next((reason for hit, reason in checks if hit), None)
