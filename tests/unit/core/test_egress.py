"""The webhook egress policy: which addresses a user's URL may reach from the server."""

from __future__ import annotations

import ipaddress

import pytest

from gpucloud.core.egress import EgressPolicy, EgressRefused, Resolver, parse_networks


def resolver(answers: dict[str, list[str]]) -> Resolver:
    def resolve(host: str, port: int) -> list[str]:
        if host not in answers:
            raise OSError("Name or service not known")
        return answers[host]
    return resolve


@pytest.mark.parametrize(("address", "permitted"), [
    ("127.0.0.1", False), ("127.8.9.1", False), ("::1", False), ("169.254.169.254", False),
    ("fe80::1", False), ("0.0.0.0", False), ("::ffff:127.0.0.1", False),
    ("fd00:ec2::254", False), ("224.0.0.1", False), ("10.1.2.3", True),
    ("192.168.1.5", True), ("93.184.216.34", True), ("2001:db8::1", True),
])
def test_default_policy(address: str, permitted: bool) -> None:
    assert EgressPolicy.default().permits(ipaddress.ip_address(address)) is permitted


def test_allowed_networks_override_denied_ones() -> None:
    policy = EgressPolicy(EgressPolicy.default().denied + parse_networks("10.0.0.0/8", "d"),
                          allowed=parse_networks("127.0.0.1/32,10.9.0.0/16", "a"))
    assert policy.permits(ipaddress.ip_address("127.0.0.1"))
    assert not policy.permits(ipaddress.ip_address("127.0.0.2"))
    assert policy.permits(ipaddress.ip_address("10.9.1.1"))
    assert not policy.permits(ipaddress.ip_address("10.1.1.1"))


def test_every_resolved_address_is_checked() -> None:
    policy = EgressPolicy.default()
    answers = resolver({"mixed.example": ["93.184.216.34", "169.254.169.254"],
                        "ok.example": ["93.184.216.34", "2001:db8::1", "93.184.216.34"]})
    with pytest.raises(EgressRefused, match="169.254.169.254"):
        policy.resolve("https://mixed.example/hook", answers)
    with pytest.raises(EgressRefused, match="does not resolve"):
        policy.resolve("https://nowhere.example/hook", answers)
    target = policy.resolve("https://ok.example:8443/a?b=1", answers)
    assert target.addresses == ("93.184.216.34", "2001:db8::1")
    assert target.pinned_url("2001:db8::1") == "https://[2001:db8::1]:8443/a?b=1"
    assert target.pinned_url("93.184.216.34") == "https://93.184.216.34:8443/a?b=1"
    assert target.host == "ok.example"


def test_literals_are_checked_at_once_and_names_later() -> None:
    policy = EgressPolicy.default()
    with pytest.raises(EgressRefused):
        policy.check_literal("http://[::1]:8080/x")
    policy.check_literal("http://localhost:8080/x")  # a name: checked when sent
    policy.check_literal("http://10.0.0.1/x")


def test_a_bad_network_names_its_setting() -> None:
    with pytest.raises(ValueError, match="GPUCLOUD_WEBHOOK_ALLOW: 'ten' is not an IP network"):
        parse_networks("10.0.0.0/8, ten", "GPUCLOUD_WEBHOOK_ALLOW")
    assert parse_networks(" , ", "x") == ()
