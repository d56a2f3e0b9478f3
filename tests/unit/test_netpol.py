"""NetworkPolicy decisions (tsor/netpol.py) on policies built with the official client's models and
serialised as the API server sends them: allow, deny, and "cannot decide" (then TSoR stays out)."""
from __future__ import annotations

import pytest

k8s = pytest.importorskip("kubernetes", reason="the kubernetes client (pip install -e .) is needed")

from kubernetes.client import (  # noqa: E402
    ApiClient,
    V1IPBlock,
    V1LabelSelector,
    V1LabelSelectorRequirement,
    V1Namespace,
    V1NetworkPolicy,
    V1NetworkPolicyEgressRule,
    V1NetworkPolicyIngressRule,
    V1NetworkPolicyPeer,
    V1NetworkPolicyPort,
    V1NetworkPolicySpec,
    V1ObjectMeta,
)

from tsor.netpol import ALLOW, DENY, UNKNOWN, PodRef, PolicySet  # noqa: E402

API = ApiClient()
WEB = PodRef("shop", "web-1", {"app": "web"}, "10.244.1.5", {"http": 8080})
CART = PodRef("shop", "cart-1", {"app": "cart", "tier": "backend"}, "10.244.1.6", {"grpc": 9000})
SPY = PodRef("lab", "spy-1", {"app": "web"}, "10.244.2.9")


def policy(name: str, ns: str = "shop", selector: dict | None = None, ingress=None, egress=None,
           types: list[str] | None = None) -> dict:
    spec = V1NetworkPolicySpec(pod_selector=V1LabelSelector(match_labels=selector or {}), ingress=ingress,
                               egress=egress, policy_types=types)
    return API.sanitize_for_serialization(V1NetworkPolicy(metadata=V1ObjectMeta(name=name, namespace=ns), spec=spec))


def namespace(name: str, **labels: str) -> dict:
    return API.sanitize_for_serialization(V1Namespace(metadata=V1ObjectMeta(name=name, labels=labels or None)))


def peers(*ps: V1NetworkPolicyPeer) -> list:
    return list(ps)


def pods(**labels: str) -> V1NetworkPolicyPeer:
    return V1NetworkPolicyPeer(pod_selector=V1LabelSelector(match_labels=labels))


def tcp(port, end=None, protocol="TCP") -> V1NetworkPolicyPort:
    return V1NetworkPolicyPort(port=port, end_port=end, protocol=protocol)


def decide(policies: list[dict], src: PodRef, dst: PodRef, port: int, namespaces=None) -> str:
    s = PolicySet()
    s.replace(policies, namespaces if namespaces is not None else [namespace("shop"), namespace("lab")])
    return s.decide(src, dst, port)[0]


def test_no_policy_allows_and_nothing_listed_yet_is_unknown():
    assert decide([], WEB, CART, 9000) == ALLOW
    assert PolicySet().decide(WEB, CART, 9000)[0] == UNKNOWN


def test_ingress_allows_the_selected_peer_and_port_only():
    allow_web = policy("cart-in", selector={"app": "cart"},
                       ingress=[V1NetworkPolicyIngressRule(_from=peers(pods(app="web")), ports=[tcp(9000)])])
    assert decide([allow_web], WEB, CART, 9000) == ALLOW
    assert decide([allow_web], WEB, CART, 9001) == DENY                       # another port
    assert decide([allow_web], CART, CART, 9000) == DENY                      # another pod
    assert decide([allow_web], SPY, CART, 9000) == DENY                       # same labels, other namespace
    assert decide([allow_web], CART, WEB, 8080) == ALLOW                      # web is not selected: open


def test_deny_all_ingress_and_rules_add_up():
    deny_all = policy("deny", selector={}, types=["Ingress"])
    assert decide([deny_all], WEB, CART, 9000) == DENY
    allow = policy("cart-in", selector={"app": "cart"}, ingress=[V1NetworkPolicyIngressRule()])   # every peer
    assert decide([deny_all, allow], WEB, CART, 9000) == ALLOW


def test_egress_isolation_of_the_source():
    only_dns = policy("web-out", selector={"app": "web"},
                      egress=[V1NetworkPolicyEgressRule(ports=[tcp(53, protocol="UDP")])])
    assert decide([only_dns], WEB, CART, 9000) == DENY                        # egress typed by its section
    to_cart = policy("web-to-cart", selector={"app": "web"},
                     egress=[V1NetworkPolicyEgressRule(to=peers(pods(app="cart")), ports=[tcp(9000, end=9010)])])
    assert decide([only_dns, to_cart], WEB, CART, 9005) == ALLOW              # endPort range
    assert decide([only_dns, to_cart], WEB, CART, 9011) == DENY


def test_namespace_selectors_need_the_namespaces_labels():
    from_lab = policy("cart-in", selector={"app": "cart"}, ingress=[V1NetworkPolicyIngressRule(_from=[
        V1NetworkPolicyPeer(namespace_selector=V1LabelSelector(match_labels={"team": "lab"}))])])
    labelled = [namespace("shop"), namespace("lab", team="lab")]
    assert decide([from_lab], SPY, CART, 9000, labelled) == ALLOW
    assert decide([from_lab], SPY, CART, 9000, [namespace("shop")]) == UNKNOWN   # lab's labels unseen
    by_name = policy("cart-in", selector={"app": "cart"}, ingress=[V1NetworkPolicyIngressRule(_from=[
        V1NetworkPolicyPeer(namespace_selector=V1LabelSelector(match_labels={"kubernetes.io/metadata.name": "lab"}),
                            pod_selector=V1LabelSelector(match_labels={"app": "web"}))])])
    assert decide([by_name], SPY, CART, 9000) == ALLOW                        # the automatic name label
    assert decide([by_name], WEB, CART, 9000) == DENY


def test_match_expressions():
    sel = V1LabelSelector(match_expressions=[V1LabelSelectorRequirement(key="tier", operator="In",
                                                                        values=["backend"]),
                                             V1LabelSelectorRequirement(key="legacy", operator="DoesNotExist")])
    pol = API.sanitize_for_serialization(V1NetworkPolicy(
        metadata=V1ObjectMeta(name="backend", namespace="shop"),
        spec=V1NetworkPolicySpec(pod_selector=sel, policy_types=["Ingress"])))
    assert decide([pol], WEB, CART, 9000) == DENY                             # cart is tier=backend
    assert decide([pol], CART, WEB, 8080) == ALLOW                            # web is not


def test_cannot_decide_goes_unknown_unless_another_rule_allows():
    block = policy("cart-in", selector={"app": "cart"}, ingress=[V1NetworkPolicyIngressRule(_from=[
        V1NetworkPolicyPeer(ip_block=V1IPBlock(cidr="10.244.0.0/16"))])])
    assert decide([block], WEB, CART, 9000) == UNKNOWN                        # an ipBlock covering a pod
    excepted = policy("cart-in", selector={"app": "cart"}, ingress=[V1NetworkPolicyIngressRule(_from=[
        V1NetworkPolicyPeer(ip_block=V1IPBlock(cidr="10.244.0.0/16", _except=["10.244.1.0/24"]))])])
    assert decide([excepted], WEB, CART, 9000) == DENY                        # carved out: not covered
    named = policy("web-in", selector={"app": "web"},
                   ingress=[V1NetworkPolicyIngressRule(ports=[tcp("metrics"), tcp("http")])])
    assert decide([named], CART, WEB, 8080) == ALLOW                          # "http" resolves; "metrics" does not
    assert decide([named], CART, WEB, 8081) == UNKNOWN
    unknown_ports = PodRef("shop", "web-2", {"app": "web"}, "10.244.1.7", None)
    assert decide([named], CART, unknown_ports, 8080) == UNKNOWN
    also = policy("web-in-2", selector={"app": "web"}, ingress=[V1NetworkPolicyIngressRule(ports=[tcp(8081)])])
    assert decide([named, also], CART, WEB, 8081) == ALLOW                    # a rule that allows wins


def test_watch_updates():
    s = PolicySet()
    s.replace([], [namespace("shop")])
    deny = policy("deny", selector={}, types=["Ingress"])
    s.put_policy(deny)
    assert s.decide(WEB, CART, 9000)[0] == DENY
    s.delete_policy("shop", "deny")
    assert s.decide(WEB, CART, 9000)[0] == ALLOW
