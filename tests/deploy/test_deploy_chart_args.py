"""Offline checks of the command lines the Helm chart renders: every flag is one the `specdec` CLI has, the
draft's client TLS towards its target, the `helm test` client's TLS and API key, and the drain every service
is given."""

from __future__ import annotations

import argparse
import re

import pytest
from deploy_helpers import (
    RELEASE,
    SPECDEC_CONTAINERS,
    VALUES_CASES,
    container,
    flag,
    one,
    pod_spec,
    render,
    run_helm,
    specdec_containers,
    template_args,
    workloads,
)

from specdec.cli import build_parser

FULL = f"{RELEASE}-specdec"
TLS_SECRET = "specdec-tls"  # tls.secretName in ci/tls-values.yaml
TLS_ON = ("--set", "tls.enabled=true", "--set", f"tls.secretName={TLS_SECRET}")
# flag suffix -> the file of a kubernetes.io/tls Secret it names
TLS_FILES = {"cert": "tls.crt", "key": "tls.key", "ca": "ca.crt"}
# Both deployment modes with TLS on: pair Pods (ci/tls-values.yaml) and split StatefulSets.
TLS_MODES = [("tls", ()), ("split", TLS_ON)]
TEST_POD = f"{FULL}-test-generate"


def mounted_secret_file(doc: dict, c: dict, path: str) -> tuple[str, str]:
    """(Secret name, key) of the file at `path` in container `c`: it must lie in a Secret volume `c` mounts whole
    (a `subPath` mount never sees the Secret's updates: a renewed certificate would not reach the service)."""
    volumes = {v["name"]: v for v in pod_spec(doc)["volumes"]}
    for mount in c["volumeMounts"]:
        prefix = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(prefix):
            secret = volumes[mount["name"]].get("secret")
            assert secret, f"{c['name']}: {path} is on volume {mount['name']!r}, not a Secret"
            assert "subPath" not in mount, f"{c['name']}: {path} is mounted by subPath"
            key = path.removeprefix(prefix)
            if "items" in secret:  # only the listed keys become files
                assert key in [item["path"] for item in secret["items"]], (c["name"], path)
            return secret["secretName"], key
    raise AssertionError(f"{c['name']}: {path} is under none of its volumeMounts")


def cli_options(command: str) -> set[str]:
    """Every option string of `specdec COMMAND` (exact names: argparse would also accept abbreviations)."""
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return set(subparsers.choices[command]._option_string_actions)


# ---------- every flag exists ----------


@pytest.mark.parametrize(("case", "extra"), [(case, ()) for case in VALUES_CASES] + [("split", TLS_ON)])
def test_every_rendered_command_line_parses_with_the_specdec_cli(case, extra):
    checked = set()
    for doc in workloads(render(case, *extra)):
        for c in pod_spec(doc)["containers"]:
            if c["name"] not in SPECDEC_CONTAINERS | {"generate"}:
                continue
            args = [_expand(a, c) for a in c["args"]]
            options = cli_options(args[0])
            names = [a.split("=", 1)[0] for a in args[1:] if a.startswith("--")]
            assert not [n for n in names if n not in options], (c["name"], sorted(options))
            try:
                build_parser().parse_args(args)
            except SystemExit:
                pytest.fail(f"specdec {args[0]} refuses the rendered args of {c['name']}: {args}")
            checked.add(c["name"])
    expected = SPECDEC_CONTAINERS | {"generate"}
    assert checked == (expected - {"target"} if case == "colocated" else expected)  # colocated: the draft runs both


def _expand(arg: str, container: dict) -> str:
    """`arg` as the process gets it: Kubernetes expands `$(NAME)` from the container's env (a split pair's draft
    names its target `...-$(POD_INDEX)...`, the pod index from a label); a value known only at run time reads 0."""
    env = {e["name"]: e.get("value", "0") for e in container.get("env", [])}
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


# ---------- TLS: the draft is a client of its target ----------


@pytest.mark.parametrize(("case", "extra"), TLS_MODES)
def test_every_draft_speaks_tls_to_its_target_with_the_mounted_secret(case, extra):
    drafts = [(doc, c) for doc, c in specdec_containers(render(case, *extra)) if c["name"] == "draft"]
    assert drafts
    for doc, c in drafts:
        for suffix, key in TLS_FILES.items():
            server_path, client_path = flag(c, f"tls-{suffix}"), flag(c, f"target-tls-{suffix}")
            assert client_path, f"{doc['metadata']['name']}: no --target-tls-{suffix}"
            assert mounted_secret_file(doc, c, client_path) == (TLS_SECRET, key)
            assert client_path == server_path, "one certificate for both sides"


def test_without_a_ca_clients_still_present_the_certificate():
    """tls.ca=false: no --*tls-ca (no client-certificate requirement), but the clients still switch TLS on."""
    docs = render("tls", "--set", "tls.ca=false")
    draft = container(one(docs, "StatefulSet", f"{FULL}-pair"), "draft")
    test_client = container(one(docs, "Pod", TEST_POD), "generate")
    for c, prefix in ((draft, "target-"), (draft, ""), (test_client, "")):
        assert flag(c, f"{prefix}tls-cert") == "/etc/specdec/tls/tls.crt", (c["name"], prefix)
        assert flag(c, f"{prefix}tls-key") == "/etc/specdec/tls/tls.key", (c["name"], prefix)
        assert flag(c, f"{prefix}tls-ca") is None, (c["name"], prefix)


def test_no_client_tls_flags_when_tls_is_off():
    for case in ("default", "split"):
        for _, c in specdec_containers(render(case)):
            assert not [a for a in c["args"] if "tls-" in a], (case, c["name"])


# ---------- the helm test client ----------


def test_helm_test_client_sends_its_certificate_and_the_api_key():
    docs = render("tls")
    pod = one(docs, "Pod", TEST_POD)
    c = container(pod, "generate")
    for suffix, key in TLS_FILES.items():
        path = flag(c, f"tls-{suffix}")
        assert path, f"no --tls-{suffix}: mutual TLS would refuse the test client"
        assert mounted_secret_file(pod, c, path) == (TLS_SECRET, key)
    secret = one(docs, "Secret", f"{FULL}-api-key")
    key_file = flag(c, "api-key-file")
    assert key_file, "no --api-key-file: the gateway would answer UNAUTHENTICATED"
    name, key = mounted_secret_file(pod, c, key_file)
    assert name == secret["metadata"]["name"] and key in secret["data"]
    assert key_file == flag(container(one(docs, "Deployment", f"{FULL}-gateway"), "gateway"), "api-key-file")
    assert c["args"][-1] == "def fib(n):", "the prompt stays the positional argument"


def test_helm_test_client_reads_the_key_from_an_existing_secret():
    docs = render("tls", "--set", "gateway.apiKey.existingSecret=my-keys", "--set", "gateway.apiKey.secretKey=token")
    pod = one(docs, "Pod", TEST_POD)
    c = container(pod, "generate")
    assert mounted_secret_file(pod, c, flag(c, "api-key-file")) == ("my-keys", "token")


def test_helm_test_client_is_plaintext_without_tls_or_keys():
    c = container(one(render("default"), "Pod", TEST_POD), "generate")
    assert not [a for a in c["args"] if a.startswith(("--tls-", "--api-key-file"))]
    assert [m["name"] for m in c["volumeMounts"]] == ["tmp"]


# ---------- drain ----------


@pytest.mark.parametrize("case", ["default", "split"])
def test_drain_seconds_reach_every_service_within_its_grace_period(case):
    docs = render(case, "--set", "drainSeconds=120")
    seen = set()
    for doc, c in specdec_containers(docs):
        seen.add(c["name"])
        assert flag(c, "drain-seconds") == "120", (doc["metadata"]["name"], c["name"])
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        assert pod_spec(doc)["terminationGracePeriodSeconds"] > 120 + pre_stop, (doc["metadata"]["name"], c["name"])
    assert seen == SPECDEC_CONTAINERS


# ---------- the gateway's wait for a pair ----------


@pytest.mark.parametrize(("sets", "want"), [((), "30"), (("--set", "gateway.pairWaitSeconds=300"), "300")])
def test_the_gateway_waits_for_a_restarting_pair_as_set(sets, want):
    """`gateway.pairWaitSeconds` reaches `--pair-wait-seconds` (a GPU pair's restart may outlast the default)."""
    docs = render("default", *sets)
    (gateway,) = [c for _, c in specdec_containers(docs) if c["name"] == "gateway"]
    assert flag(gateway, "pair-wait-seconds") == want


# ---------- the pair's batch ----------


@pytest.mark.parametrize("case", ["default", "split", "colocated"])
def test_the_pairs_batch_reaches_the_draft_whose_scheduler_decides_it(case):
    """The draft's scheduler decides how many requests a Verify carries, so `target.maxBatchSize` reaches the draft
    too (QA: with only the target given `--max-batch-size 2`, Verify batches of 6 went through it), and
    `draft.maxBatchSize` overrides it for the draft alone."""
    def batch_flags(*sets):
        return {c["name"]: flag(c, "max-batch-size") for _, c in specdec_containers(render(case, *sets))
                if c["name"] in ("draft", "target")}

    assert set(batch_flags().values()) <= {None} | ({"64"} if case == "colocated" else set())
    both = batch_flags("--set", "target.maxBatchSize=128")
    assert both["draft"] == "128" and both.get("target", "128") == "128"
    if case == "colocated":  # one process, one batch: the two values must agree (test_deploy_chart.py)
        return
    own = batch_flags("--set", "target.maxBatchSize=128", "--set", "draft.maxBatchSize=32")
    assert own["draft"] == "32" and own["target"] == "128"


@pytest.mark.parametrize("case", ["default", "split", "tls", "colocated"])
def test_the_target_serves_a_verify_lane_where_its_draft_can_use_it(case):
    """Plaintext targets serve the verify lane (the flag, a named container port; with pairing=split the
    NetworkPolicy lets the drafts reach it); with TLS or no target container there is none."""
    extra = ("--set", "networkPolicy.enabled=true")
    docs = render(case, *extra)
    targets = [container(d, "target") for d in workloads(docs)
               if "target" in {c["name"] for c in pod_spec(d)["containers"]}]
    lane = case in ("default", "split")
    assert bool(targets) == (case != "colocated")
    for c in targets:
        assert flag(c, "verify-lane-port") == ("50062" if lane else None)
        assert ({"name": "lane-target", "containerPort": 50062, "protocol": "TCP"} in c["ports"]) == lane
    if case == "split":
        policy = one(docs, "NetworkPolicy", f"{FULL}-target")
        rules = [r for r in policy["spec"]["ingress"] if r["ports"] == [{"port": 50062, "protocol": "TCP"}]]
        assert len(rules) == 1 and rules[0]["from"][0]["podSelector"]["matchLabels"][
            "app.kubernetes.io/component"] == "draft"


@pytest.mark.parametrize(("port", "why"), [("9102", "also target.port or target.metricsPort"),
                                           ("50051", "draft.port and target.verifyLanePort are both 50051")])
def test_a_verify_lane_port_another_port_holds_is_refused(port, why):
    proc = run_helm(*template_args("default", "--set", f"target.verifyLanePort={port}"), check=False)
    assert proc.returncode != 0 and why in proc.stderr
