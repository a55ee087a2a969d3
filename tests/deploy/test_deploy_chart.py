"""Offline checks of the Helm chart: helm lint --strict, Kubernetes schema validation of the rendered
manifests (kubernetes-validate --strict), and assertions on what the manifests say."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml
from deploy_helpers import (
    CHART,
    KUBE_VERSIONS,
    NAMESPACE,
    RELEASE,
    SPECDEC_CONTAINERS,
    VALUES_CASES,
    ci_values,
    container,
    env,
    find,
    flag,
    flags,
    one,
    pod_spec,
    render,
    render_text,
    run_helm,
    specdec_containers,
    template_args,
    values_args,
    workloads,
)

FULL = f"{RELEASE}-specdec"
# Kinds that are CustomResourceDefinitions of other projects: kubernetes-validate bundles only the built-in
# API schemas, so these are checked by the assertions below instead of against a schema.
CRD_KINDS = {"ServiceMonitor"}
HEALTH_NAMES = {
    "gateway": "specdec.v1.GatewayService",
    "draft": "specdec.v1.DraftService",
    "target": "specdec.v1.TargetService",
}
GRPC_PORT_NAMES = {"gateway": "grpc", "draft": "grpc-draft", "target": "grpc-target"}


# ---------- helm lint and schema validation ----------


@pytest.mark.parametrize("case", VALUES_CASES)
def test_helm_lint_strict(case):
    proc = run_helm("lint", "--strict", str(CHART), "--namespace", NAMESPACE, *values_args(case))
    assert "0 chart(s) failed" in proc.stdout


def test_rendered_manifests_pass_kubernetes_validate_strict(tmp_path):
    """Every rendered object of every values file, against the bundled schemas of each supported version."""
    files, skipped = [], set()
    for case in VALUES_CASES:
        docs = render(case)
        skipped |= {d["kind"] for d in docs if d["kind"] in CRD_KINDS}
        plain = [d for d in docs if d["kind"] not in CRD_KINDS]
        path = tmp_path / f"{case}.yaml"
        path.write_text(yaml.safe_dump_all(plain))
        files.append(str(path))
    assert skipped == CRD_KINDS, "every CRD kind we skip should actually be rendered by some values file"
    for version in KUBE_VERSIONS:
        cmd = [sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", "-k", version, *files]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"kubernetes-validate -k {version}:\n{proc.stdout}\n{proc.stderr}"


def test_kubernetes_validate_bundles_the_versions_we_ask_for():
    from kubernetes_validate.utils import all_versions

    assert set(KUBE_VERSIONS) <= set(all_versions())


def test_values_schema_is_self_contained_and_enforced():
    text = (CHART / "values.schema.json").read_text()
    schema = json.loads(text)
    assert "$ref" not in text and "$id" not in schema
    assert schema["additionalProperties"] is False
    for bad in (["--set", "device=tpu"], ["--set", "pairing=triple"], ["--set", "gateway.prot=1"]):
        proc = run_helm(*template_args("default", *bad), check=False)
        assert proc.returncode != 0 and "specdec" in proc.stderr, bad


@pytest.mark.parametrize(("overrides", "at"), [
    # values that rendered, passed kubernetes-validate --strict, and then failed at the API server or the kubelet (QA)
    (["--set", "gateway.livenessProbe.successThreshold=2"], "/gateway/livenessProbe/successThreshold"),
    (["--set", "target.startupProbe.successThreshold=3"], "/target/startupProbe/successThreshold"),
    (["--set", "imagePullSecrets[0]=regcred"], "/imagePullSecrets/0"),  # a LocalObjectReference: [{name: regcred}]
    (["--set", "models.source=hostPath", "--set", "models.hostPath.path=mnt/models"], "/models/hostPath/path"),
    (["--set", "tmpSizeLimit=lots"], "/tmpSizeLimit"),
    (["--set", "pairs.shmSizeLimit=8GB"], "/pairs/shmSizeLimit"),
    (["--set", "models.pvc.size=100 Gi"], "/models/pvc/size"),
    (["--set", "tracing.sampler=sometimes"], "/tracing/sampler"),  # the SDK would ignore it with a warning (QA)
])
def test_the_schema_refuses_values_the_api_server_would(overrides, at):
    proc = run_helm(*template_args("default", *overrides), check=False)
    assert proc.returncode != 0 and at in proc.stderr, proc.stderr
    # and the well-formed spellings render
    for good in (["--set", "draft.readinessProbe.successThreshold=2"], ["--set", "imagePullSecrets[0].name=regcred"],
                 ["--set", "pairs.shmSizeLimit=8Gi", "--set", "tmpSizeLimit=500M", "--set", "models.pvc.size=100Gi"]):
        assert run_helm(*template_args("default", *good), check=False).returncode == 0, good


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--set", "tls.enabled=true"], "tls.secretName"),
        (["--set", "gateway.apiKey.enabled=true"], "gateway.apiKey.existingSecret"),
        (["--set", "models.source=hostPath"], "models.hostPath.path"),
        (["--set", "models.source=image"], "models.image.repository"),
        (["--set", "tracing.enabled=true"], "tracing.otlpEndpoint"),
        # a bundled Jaeger nobody sends to (the services export to the endpoint): one or the other (QA)
        (["--set", "tracing.enabled=true", "--set", "tracing.jaeger.enabled=true",
          "--set", "tracing.otlpEndpoint=http://collector:4317"], "set one of the two"),
        (["--set", "gateway.autoscaling.enabled=true", "--set", "gateway.autoscaling.minReplicas=5",
          "--set", "gateway.autoscaling.maxReplicas=2"], "minReplicas 5 exceeds maxReplicas 2"),
        (["--set", "draft.numDraftTokens=65"], "numDraftTokens"),  # the target verifies at most 64
        (["--set", "target.gpus=2"], "gpus"),  # no tensor parallelism: a second GPU would sit idle
        # values the services refuse at start (CrashLoopBackOff on a cluster, QA): refused at render
        (["--set", "draft.numSteps=2"], "draft.numDraftTokens 5 exceeds what draft.numSteps 2 of draft.topk 1 can "
                                        "grow (2)"),
        (["--set", "draft.numDraftTokens=64"], "can grow (5)"),
        (["--set", "target.pageSize=7"], "pageSize"),  # a power of two
        (["--set", "engineStallSeconds=0.5"], "engineStallSeconds"),  # 0 or at least 1 (the services exit 2)
        # a Jaeger alone deployed nothing and every container got OTEL_SDK_DISABLED (QA)
        (["--set", "tracing.jaeger.enabled=true"], "tracing.jaeger.enabled=true deploys a Jaeger only for "
                                                   "tracing.enabled=true"),
        # a pair's two containers share the pod's network: the second to bind a port failed at start (QA)
        (["--set", "target.metricsPort=9101"], "draft.metricsPort and target.metricsPort are both 9101"),
        (["--set", "draft.port=50052"], "draft.port and target.port are both 50052"),
        # a service's own two ports, in any pairing; flashinfer without a GPU: rendered, then refused at start (QA)
        (["--set", "gateway.metricsPort=50050"], "gateway.port and gateway.metricsPort are both 50050"),
        (["--set", "pairing=split", "--set", "draft.metricsPort=50051"],
         "draft.port and draft.metricsPort are both 50051"),
        (["--set", "pairing=split", "--set", "target.metricsPort=50052"],
         "target.port and target.metricsPort are both 50052"),
        (["--set", "pairing=colocated", "--set", "draft.metricsPort=50051"],
         "draft.port and draft.metricsPort are both 50051"),
        (["--set", "target.attentionBackend=flashinfer"], "target.attentionBackend=flashinfer needs device=cuda"),
        (["--set", "draft.attentionBackend=flashinfer"], "draft.attentionBackend=flashinfer needs device=cuda"),
    ],
)
def test_incomplete_settings_fail_with_a_message(overrides, message):
    proc = run_helm(*template_args("default", *overrides), check=False)
    assert proc.returncode != 0
    assert message in proc.stderr


def test_the_tree_and_pool_values_the_services_take_render():
    docs = render("default", "--set", "draft.numSteps=4", "--set", "draft.topk=4", "--set", "draft.numDraftTokens=12",
                  "--set", "target.pageSize=32", "--set", "target.numPages=0")
    pair = one(docs, "StatefulSet", f"{FULL}-pair")
    draft, target = container(pair, "draft"), container(pair, "target")
    assert (flag(draft, "num-steps"), flag(draft, "topk"), flag(draft, "num-draft-tokens")) == ("4", "4", "12")
    assert (flag(target, "page-size"), flag(target, "num-pages")) == ("32", "0")  # 0: sized from memory


def test_an_ipv6_listen_host_renders_as_a_string_kubernetes_accepts(tmp_path):
    """`listenHost: "::"` (the chart README's advice for IPv6-only clusters) rendered `- --host=::`, which YAML reads
    as a map {'--host=:': None}: kubernetes-validate refused the gateway Deployment and the pair StatefulSet."""
    for pairing in ("pair", "colocated"):
        docs = render("default", "--set-string", "listenHost=::", "--set", f"pairing={pairing}")
        hosts = [a for _, c in specdec_containers(docs) for a in c.get("args", []) if str(a).startswith("--host")]
        assert hosts and all(a == "--host=::" for a in hosts), hosts
        path = tmp_path / f"{pairing}.yaml"
        path.write_text(yaml.safe_dump_all([d for d in docs if d["kind"] not in CRD_KINDS]))
        proc = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", "-k",
                               KUBE_VERSIONS[0], str(path)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------- the default: CPU, bundled tiny model, one pair Pod ----------


def test_default_runs_on_cpu_with_the_bundled_model():
    docs = render("default")
    assert "nvidia.com/gpu" not in render_text("default")
    pair = one(docs, "StatefulSet", f"{FULL}-pair")
    assert [c["name"] for c in pod_spec(pair)["containers"]] == ["draft", "target"]
    draft, target = container(pair, "draft"), container(pair, "target")
    assert flag(draft, "target") == "localhost:50052", "draft and target share the Pod and talk over localhost"
    assert flag(draft, "device") == flag(target, "device") == "cpu"
    assert flag(draft, "two-batch-overlap") is None, "on CPU the services share the cores: no overlap"
    assert flag(draft, "attention-backend") is None and flag(target, "attention-backend") is None  # torch on CPU
    assert flag(draft, "feature-wire") == "native"
    assert flag(draft, "token-map") is None  # the whole vocabulary
    assert flag(draft, "speculation") == "auto"
    assert flag(draft, "plain-steps") is None and flag(target, "plain-steps") is None  # the services' defaults
    assert flag(target, "model") == "/opt/specdec/models/tiny-code/target"
    assert flag(draft, "model") == "/opt/specdec/models/tiny-code/draft"
    assert flag(draft, "target-model") == flag(target, "model")
    for c in (draft, target):
        assert c["image"] == "ghcr.io/specdec/specdec:0.1.0", "CPU pairs use the slim image"
    assert "volumes" in pod_spec(pair) and not any(v["name"] == "models" for v in pod_spec(pair)["volumes"])
    gateway = container(one(docs, "Deployment", f"{FULL}-gateway"), "gateway")
    host = f"{FULL}-pair-0.{FULL}-pair.{NAMESPACE}.svc.cluster.local"
    assert flags(gateway, "pair") == [f"{host}:50051={host}:50052"]
    assert flag(gateway, "model") == flag(target, "model"), "the gateway reads the target's tokenizer"


def test_plain_steps_reach_both_services_when_set():
    pair = one(render("default", "--set", "draft.plainSteps=8", "--set", "target.plainSteps=2"), "StatefulSet",
               f"{FULL}-pair")
    assert flag(container(pair, "draft"), "plain-steps") == "8"
    assert flag(container(pair, "target"), "plain-steps") == "2"
    proc = run_helm(*template_args("default", "--set", "draft.plainSteps=65"), check=False)
    assert proc.returncode != 0 and "plainSteps" in proc.stderr


def test_prefill_chunk_tokens_reach_the_target_that_runs_the_prompts():
    """`target.prefillChunkTokens`: the target container's flag (the draft's when it runs the target in-process);
    unset, the service's default by device."""
    pair = one(render("default"), "StatefulSet", f"{FULL}-pair")
    assert flag(container(pair, "target"), "prefill-chunk-tokens") is None
    pair = one(render("default", "--set", "target.prefillChunkTokens=0"), "StatefulSet", f"{FULL}-pair")
    assert flag(container(pair, "target"), "prefill-chunk-tokens") == "0"
    assert flag(container(pair, "draft"), "prefill-chunk-tokens") is None
    pair = one(render("colocated", "--set", "target.prefillChunkTokens=1024"), "StatefulSet", f"{FULL}-pair")
    assert flag(container(pair, "draft"), "prefill-chunk-tokens") == "1024"
    for bad in ("-1", "8"):  # the flag takes 0 or at least 16
        proc = run_helm(*template_args("default", "--set", f"target.prefillChunkTokens={bad}"), check=False)
        assert proc.returncode != 0 and "prefillChunkTokens" in proc.stderr


def test_calibration_max_batch_is_the_drafts_default_unless_set():
    def rendered(*sets: str):
        return flag(container(one(render("default", *sets), "StatefulSet", f"{FULL}-pair"), "draft"),
                    "calibration-max-batch")

    assert rendered() is None  # the draft's own default: its max batch size on a GPU, 1 on a CPU
    assert rendered("--set", "draft.calibrationMaxBatch=0") == "0"  # none
    assert rendered("--set", "draft.calibrationMaxBatch=32") == "32"
    proc = run_helm(*template_args("default", "--set", "draft.calibrationMaxBatch=-1"), check=False)
    assert proc.returncode != 0 and "calibrationMaxBatch" in proc.stderr


@pytest.mark.parametrize("key, flag_name, default, other, bad", [
    ("plainCallsInFlight", "plain-calls-in-flight", "2", "1", "0"),  # calls in flight: at least one
    ("promptFeatureMb", "prompt-feature-mb", "64", "0", "-1"),  # the admission's feature budget: 0 = whole prompts
    ("targetWaitSeconds", "target-wait-seconds", "1800", "600", "0"),  # the target's start-up budget
])
def test_a_draft_value_reaches_its_flag_and_a_bad_one_is_refused(key, flag_name, default, other, bad):
    pair = one(render("default"), "StatefulSet", f"{FULL}-pair")
    assert flag(container(pair, "draft"), flag_name) == default
    pair = one(render("default", "--set", f"draft.{key}={other}"), "StatefulSet", f"{FULL}-pair")
    assert flag(container(pair, "draft"), flag_name) == other
    proc = run_helm(*template_args("default", "--set", f"draft.{key}={bad}"), check=False)
    assert proc.returncode != 0 and key in proc.stderr


def test_served_model_name_reaches_the_gateway_when_set():
    gateway = container(one(render("default"), "Deployment", f"{FULL}-gateway"), "gateway")
    assert flag(gateway, "served-model-name") is None
    gateway = container(one(render("default", "--set", "gateway.servedModelName=code tiny: v1"), "Deployment",
                            f"{FULL}-gateway"), "gateway")
    assert flag(gateway, "served-model-name") == "code tiny: v1"
    proc = run_helm(*template_args("default", "--set", "gateway.servedModelName= padded"), check=False)
    assert proc.returncode != 0 and "servedModelName" in proc.stderr


def test_speculation_can_be_switched_off_and_other_modes_are_refused():
    pair = one(render("default", "--set", "draft.speculation=off"), "StatefulSet", f"{FULL}-pair")
    assert flag(container(pair, "draft"), "speculation") == "off"
    proc = run_helm(*template_args("default", "--set", "draft.speculation=sometimes"), check=False)
    assert proc.returncode != 0 and "speculation" in proc.stderr


def test_pairs_have_headless_services_for_stable_names():
    for case, names in (("default", ["pair"]), ("split", ["draft", "target"])):
        docs = render(case)
        for name in names:
            sts = one(docs, "StatefulSet", f"{FULL}-{name}")
            svc = one(docs, "Service", f"{FULL}-{name}")
            assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
            assert svc["spec"]["clusterIP"] == "None"
            assert sts["spec"]["podManagementPolicy"] == "Parallel"


# ---------- GPUs ----------


def gpu_count(c: dict, section: str) -> int | None:
    return c.get("resources", {}).get(section, {}).get("nvidia.com/gpu")


def test_gpu_pair_gives_draft_and_target_their_own_gpu():
    docs = render("gpu-pair")
    pair = one(docs, "StatefulSet", f"{FULL}-pair")
    assert pair["spec"]["replicas"] == 2
    for name in ("draft", "target"):
        c = container(pair, name)
        assert gpu_count(c, "limits") == gpu_count(c, "requests") == 1, name
        assert flag(c, "device") == "cuda"
        assert c["image"] == "ghcr.io/specdec/specdec-cuda:0.1.0"
        assert flag(c, "dtype") == "bfloat16"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    # flashinfer for both on GPUs without asking (the draft's CUDA graphs need it); the example drafts a chain
    assert flag(container(pair, "target"), "attention-backend") == "flashinfer"
    assert flag(container(pair, "draft"), "attention-backend") == "flashinfer"
    assert flag(container(pair, "draft"), "topk") == "1"
    assert flag(container(pair, "draft"), "two-batch-overlap") == "32", "own GPUs: micro-batches take turns"
    assert flag(container(pair, "draft"), "model") == "/models/EAGLE3-LLaMA3.1-Instruct-8B"
    mapped = one(render("gpu-pair", "--set", "models.tokenMapFile=maps/llama3-32k.json"), "StatefulSet",
                 f"{FULL}-pair")
    assert flag(container(mapped, "draft"), "token-map") == "/models/maps/llama3-32k.json"
    spec = pod_spec(pair)
    assert spec["runtimeClassName"] == "nvidia"
    models = next(v for v in spec["volumes"] if v["name"] == "models")
    assert models["persistentVolumeClaim"] == {"claimName": "llama-weights", "readOnly": True}
    assert not find(docs, "PersistentVolumeClaim"), "an existing claim is used, none is created"
    gateway_doc = one(docs, "Deployment", f"{FULL}-gateway")
    assert "nvidia.com/gpu" not in json.dumps(gateway_doc), "the gateway needs no GPU"
    pairs = flags(container(gateway_doc, "gateway"), "pair")
    assert [p.split(".")[0] for p in pairs] == [f"{FULL}-pair-0", f"{FULL}-pair-1"]


def test_colocated_runs_one_container_that_serves_both_on_one_gpu():
    """pairing=colocated: each pair Pod runs `serve-draft --target in-process` alone (one GPU), the gateway names
    its one port for both parts, the Service, metrics Services and NetworkPolicy expose only that container's ports,
    the target's KV values size its pools, and flags for a remote target are left out."""
    docs = render("colocated", "--set", "tls.enabled=true", "--set", "tls.secretName=certs")
    pair = one(docs, "StatefulSet", f"{FULL}-pair")
    (draft,) = pod_spec(pair)["containers"]
    args = draft["args"]
    assert draft["name"] == "draft" and args[0] == "serve-draft" and "--target=in-process" in args
    assert {"--num-pages=16384", "--max-batch-size=64", "--request-idle-seconds=120"} <= set(args)
    assert not [a for a in args if a.startswith(("--target-tls", "--feature-wire", "--two-batch-overlap",
                                                            "--target-wait-seconds"))]
    assert draft["resources"]["limits"]["nvidia.com/gpu"] == 1
    gateway_args = pod_spec(one(docs, "Deployment", f"{FULL}-gateway"))["containers"][0]["args"]
    pairs = [a.split("=", 1)[1] for a in gateway_args if a.startswith("--pair=")]
    assert len(pairs) == 2 and all(p.split("=")[0] == p.split("=")[1] and p.endswith(":50051") for p in pairs)
    assert [p["name"] for p in one(docs, "Service", f"{FULL}-pair")["spec"]["ports"]] == ["grpc-draft"]
    metrics = sorted(s["metadata"]["labels"]["specdec/metrics"] for s in find(docs, "Service")
                     if s["metadata"]["name"].endswith("-metrics"))
    assert metrics == ["draft", "gateway"]
    policy = one(docs, "NetworkPolicy", f"{FULL}-pair")
    assert [r["ports"][0]["port"] for r in policy["spec"]["ingress"]][:1] == [50051]
    bad = run_helm(*template_args("colocated", "--set", "draft.featureWire=fp8"), check=False)
    assert bad.returncode != 0 and "draft.featureWire must be native" in bad.stderr


@pytest.mark.parametrize("sets", [
    ("target.resources.limits.memory=96Gi",),  # docs/deploy.md's GPU advice, then `--set pairing=colocated`
    ("target.startupProbe.failureThreshold=720",),  # a longer load for a big target
    ("target.livenessProbe.failureThreshold=12",),
])
def test_colocated_refuses_target_resources_and_probes_it_would_drop(sets):
    """pairing=colocated's one container takes draft.resources and the draft's probes: a target memory limit or startup
    budget set for the target model was dropped without a word (QA: `-f ci/gpu-pair-values.yaml --set
    pairing=colocated` rendered a 32Gi limit where the target asked for 96Gi). Refused, naming the draft value."""
    key = sets[0].split(".")[1]
    bad = run_helm(*template_args("colocated", *[a for s in sets for a in ("--set", s)]), check=False)
    assert bad.returncode != 0, f"{sets} rendered"
    assert f"target.{key}" in bad.stderr and f"set draft.{key}" in bad.stderr, bad.stderr
    gpu_pair = run_helm(*template_args("gpu-pair", "--set", "pairing=colocated"), check=False)
    assert gpu_pair.returncode != 0 and "target.resources" in gpu_pair.stderr
    # the same value on both renders, and so do the defaults (ci/colocated-values.yaml sets draft.resources only)
    both = [a for s in sets for a in ("--set", s, "--set", s.replace("target.", "draft.", 1))]
    assert run_helm(*template_args("default", "--set", "pairing=colocated", *both), check=False).returncode == 0


def test_the_chart_knows_the_target_defaults_it_compares_with():
    """`specdec.targetPodDefaults` (what pairing=colocated takes for "not set") must stay values.yaml's."""
    text = (CHART / "templates" / "_helpers.tpl").read_text()
    block = text.split('{{- define "specdec.targetPodDefaults" -}}', 1)[1].split("{{- end -}}", 1)[0]
    defaults = yaml.safe_load(block)
    values = yaml.safe_load((CHART / "values.yaml").read_text())["target"]
    assert defaults == {key: values[key] for key in defaults}


@pytest.mark.parametrize(("sets", "named"), [
    (("target.dtype=float16",), "target.dtype (float16) differs from draft.dtype"),
    (("target.attentionBackend=torch",), "target.attentionBackend (torch) differs"),
    (("target.cudaGraph=false",), "target.cudaGraph (false) differs"),
    (("target.extraArgs[0]=--max-queue-wait-seconds=5",), "target.extraArgs would be dropped"),
    (("target.extraEnv[0].name=X", "target.extraEnv[0].value=1"), "target.extraEnv would be dropped"),
    (("draft.maxBatchSize=32",), "target.maxBatchSize (64) differs from draft.maxBatchSize (32)"),
    (("target.plainSteps=8",), "target.plainSteps (8) would be dropped"),
])
def test_colocated_refuses_target_settings_it_would_drop(sets, named):
    """pairing=colocated has no target container: a target setting that would be dropped silently (QA) is refused,
    naming the draft value that carries it; the same value on both, or the target's default, renders."""
    bad = run_helm(*template_args("colocated", *[a for s in sets for a in ("--set", s)]), check=False)
    assert bad.returncode != 0 and named in bad.stderr, bad.stderr
    for same in (("target.dtype=bfloat16",), ("target.attentionBackend=flashinfer",), ("target.cudaGraph=true",),
                 ("target.dtype=bfloat16", "draft.dtype=auto"), ("draft.maxBatchSize=64",),  # auto: bf16 on cuda
                 ("target.dtype=",), ("draft.dtype=", "target.dtype=bfloat16")):  # "": the default, auto (QA)
        sets = [a for s in same for a in ("--set", s)]
        assert run_helm(*template_args("colocated", *sets), check=False).returncode == 0, same
    # on a CPU there are no CUDA graphs to differ about
    assert run_helm(*template_args("default", "--set", "pairing=colocated", "--set", "target.cudaGraph=false"),
                    check=False).returncode == 0


def test_split_scales_drafts_and_targets_together_and_pairs_them_by_index():
    docs = render("split")
    draft_sts = one(docs, "StatefulSet", f"{FULL}-draft")
    target_sts = one(docs, "StatefulSet", f"{FULL}-target")
    assert draft_sts["spec"]["replicas"] == target_sts["spec"]["replicas"] == 3
    assert not find(docs, "StatefulSet", f"{FULL}-pair")
    draft, target = container(draft_sts, "draft"), container(target_sts, "target")
    assert [c["name"] for c in pod_spec(draft_sts)["containers"]] == ["draft"]
    assert [c["name"] for c in pod_spec(target_sts)["containers"]] == ["target"]
    assert gpu_count(draft, "limits") == gpu_count(target, "limits") == 1
    target_domain = f"{FULL}-target.{NAMESPACE}.svc.cluster.local"
    assert flag(draft, "target") == f"{FULL}-target-$(POD_INDEX).{target_domain}:50052"
    pod_index = env(draft)["POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert pod_index == "metadata.labels['apps.kubernetes.io/pod-index']"
    gateway = container(one(docs, "Deployment", f"{FULL}-gateway"), "gateway")
    draft_domain = f"{FULL}-draft.{NAMESPACE}.svc.cluster.local"
    assert flags(gateway, "pair") == [
        f"{FULL}-draft-{i}.{draft_domain}:50051={FULL}-target-{i}.{target_domain}:50052" for i in range(3)
    ]
    assert "--disable-cuda-graph" in target["args"] and "--disable-cuda-graph" not in draft["args"]
    assert flag(target, "num-pages") == "4096"
    models = next(v for v in pod_spec(target_sts)["volumes"] if v["name"] == "models")
    assert models["hostPath"] == {"path": "/mnt/models", "type": "Directory"}


def test_models_from_an_image_are_copied_by_an_init_container():
    docs = render("tracing")
    for doc in workloads(docs):
        if doc["metadata"]["name"].endswith("test-generate") or "jaeger" in doc["metadata"]["name"]:
            continue
        init = pod_spec(doc)["initContainers"]
        assert [c["name"] for c in init] == ["copy-models"]
        assert init[0]["image"] == "registry.example.com/specdec-weights:tiny-code"
        assert init[0]["command"] == ["cp", "-R", "/models/.", "/mnt/models/"]
        # its own requests and limits: a namespace with a ResourceQuota refuses a container without them (QA)
        assert init[0]["resources"] == {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}
        volume = next(v for v in pod_spec(doc)["volumes"] if v["name"] == "models")
        assert "emptyDir" in volume


def test_created_model_claim_is_kept_on_uninstall():
    docs = render("default", "--set", "models.source=pvc")
    pvc = one(docs, "PersistentVolumeClaim", f"{FULL}-models")
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


# ---------- probes and shutdown ----------


@pytest.mark.parametrize("case", VALUES_CASES)
def test_every_service_has_grpc_probes_for_its_health_name(case):
    docs = render(case)
    tls = case == "tls"
    seen = set()
    for _, c in specdec_containers(docs):
        role = c["name"]
        seen.add(role)
        port = next(p["containerPort"] for p in c["ports"] if p["name"] == GRPC_PORT_NAMES[role])
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c[kind]
            # the gateway is alive (startup, liveness) as soon as its process is, ready once a pair serves; a draft
            # alive once loaded, ready while its target answers and fits it
            name = "liveness" if role in ("gateway", "draft") and kind != "readinessProbe" else HEALTH_NAMES[role]
            if tls:  # the kubelet's gRPC probe cannot speak TLS: the image's healthcheck script does
                cmd = probe["exec"]["command"]
                assert cmd[:2] == ["python", "/opt/specdec/healthcheck.py"]
                assert f"--addr=localhost:{port}" in cmd and f"--service={name}" in cmd
                assert "--tls-ca=/etc/specdec/tls/ca.crt" in cmd
            else:
                assert probe["grpc"] == {"port": port, "service": name}, (role, kind)
    assert seen == (SPECDEC_CONTAINERS - {"target"} if case == "colocated" else SPECDEC_CONTAINERS)


def test_startup_probe_leaves_time_for_model_load_and_graph_capture():
    docs = render("gpu-pair")
    for _, c in specdec_containers(docs):
        probe = c["startupProbe"]
        budget_s = probe["periodSeconds"] * probe["failureThreshold"]
        assert budget_s >= (600 if c["name"] != "gateway" else 60), c["name"]
        if c["name"] == "draft":  # its start waits for its target first (QA: the probe equalled that wait)
            assert budget_s >= int(flag(c, "target-wait-seconds")) + 600
        # liveness only starts after the startup probe succeeded, so it may be strict
        assert c["livenessProbe"]["periodSeconds"] * c["livenessProbe"]["failureThreshold"] <= 120


@pytest.mark.parametrize("case", VALUES_CASES)
def test_termination_grace_exceeds_the_drain(case):
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    if case != "default":
        values.update(ci_values(case))
    docs = render(case)
    for doc, c in specdec_containers(docs):
        grace = pod_spec(doc)["terminationGracePeriodSeconds"]
        # every service is told the drain the grace period is sized for (no service default)
        assert flag(c, "drain-seconds") == str(values["drainSeconds"]), (doc["metadata"]["name"], c["name"])
        drain = values["drainSeconds"]
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        assert grace > drain + pre_stop, (doc["metadata"]["name"], c["name"])


def test_drain_seconds_flows_into_the_grace_period():
    docs = render("default", "--set", "drainSeconds=120")
    pair = one(docs, "StatefulSet", f"{FULL}-pair")
    assert flag(container(pair, "target"), "drain-seconds") == "120"
    assert pod_spec(pair)["terminationGracePeriodSeconds"] == 5 + 120 + 15


@pytest.mark.parametrize("case", VALUES_CASES)
def test_model_services_get_the_stall_limit_their_liveness_probe_acts_on(case):
    """Draft and target report UNKNOWN (liveness included) once their engine thread has been in one step for
    `engineStallSeconds`: every draft and target container is told it; the gateway has no engine."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    if case != "default":
        values.update(ci_values(case))
    seen = set()
    for doc, c in specdec_containers(docs := render(case)):
        if c["name"] in ("draft", "target"):
            assert flag(c, "engine-stall-seconds") == str(values["engineStallSeconds"]), (doc["metadata"]["name"],
                                                                                          c["name"])
            seen.add(c["name"])
        else:
            assert not any(str(a).startswith("--engine-stall-seconds") for a in c.get("args", [])), c["name"]
    assert seen and docs
    set_docs = render("default", "--set", "engineStallSeconds=0")
    assert flag(container(one(set_docs, "StatefulSet", f"{FULL}-pair"), "target"), "engine-stall-seconds") == "0"


# ---------- security ----------


@pytest.mark.parametrize("case", VALUES_CASES)
def test_pods_run_non_root_read_only_without_capabilities(case):
    docs = render(case)
    for doc in workloads(docs):
        spec = pod_spec(doc)
        where = f"{case}: {doc['kind']}/{doc['metadata']['name']}"
        assert spec["securityContext"]["runAsNonRoot"] is True, where
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert spec["automountServiceAccountToken"] is False, where
        tmp_volumes = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, (where, c["name"])
            assert sc["allowPrivilegeEscalation"] is False, (where, c["name"])
            assert sc["capabilities"] == {"drop": ["ALL"]}, (where, c["name"])
            if c in spec["containers"]:
                tmp = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
                assert len(tmp) == 1 and tmp[0]["name"] in tmp_volumes, (where, c["name"])
            for mount in c.get("volumeMounts", []):
                if mount["name"] in ("models", "tls", "api-key") and c["name"] != "copy-models":
                    assert mount.get("readOnly") is True, (where, c["name"], mount["name"])


def test_draft_and_target_containers_use_separate_tmp_volumes():
    pair = one(render("default"), "StatefulSet", f"{FULL}-pair")
    mounts = {
        c["name"]: next(m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/tmp")
        for c in pod_spec(pair)["containers"]
    }
    assert mounts["draft"] != mounts["target"]


def policy_sources(policy: dict, port: int) -> list[dict] | None:
    """The `from` peers allowed on `port` (None: every source)."""
    for rule in policy["spec"]["ingress"]:
        if any(p["port"] == port for p in rule["ports"]):
            return rule.get("from")
    raise AssertionError(f"{policy['metadata']['name']} does not open port {port}")


def component_selector(component: str) -> dict:
    return {
        "podSelector": {
            "matchLabels": {
                "app.kubernetes.io/name": "specdec",
                "app.kubernetes.io/instance": RELEASE,
                "app.kubernetes.io/component": component,
            }
        }
    }


def test_network_policy_lets_only_the_gateway_reach_the_pair():
    docs = render("default")
    policy = one(docs, "NetworkPolicy", f"{FULL}-pair")
    assert policy["spec"]["podSelector"] == {"matchLabels": component_selector("pair")["podSelector"]["matchLabels"]}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    for port in (50051, 50052):
        assert policy_sources(policy, port) == [component_selector("gateway")]
    assert policy_sources(policy, 9101) is None and policy_sources(policy, 9102) is None  # metrics: everyone
    ports = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert ports == {50051, 50052, 9101, 9102}, "nothing else is open"
    gateway = one(docs, "NetworkPolicy", f"{FULL}-gateway")
    assert policy_sources(gateway, 50050) is None


def test_network_policy_in_split_mode():
    docs = render("split")
    draft = one(docs, "NetworkPolicy", f"{FULL}-draft")
    target = one(docs, "NetworkPolicy", f"{FULL}-target")
    assert policy_sources(draft, 50051) == [component_selector("gateway")]
    assert policy_sources(target, 50052) == [component_selector("gateway"), component_selector("draft")]
    # every pod of the release is covered by some policy
    selected = {
        p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in find(docs, "NetworkPolicy")
    }
    components = {pod_spec_labels(d)["app.kubernetes.io/component"] for d in workloads(docs)}
    assert components - selected == {"test"}


def pod_spec_labels(doc: dict) -> dict:
    return doc["metadata"]["labels"] if doc["kind"] == "Pod" else doc["spec"]["template"]["metadata"]["labels"]


def test_restricted_gateway_policy_still_admits_the_helm_test():
    docs = render("tls")
    gateway = one(docs, "NetworkPolicy", f"{FULL}-gateway")
    sources = policy_sources(gateway, 50050)
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}} in sources
    assert component_selector("test") in sources
    assert policy_sources(gateway, 9100) == ci_values("tls")["networkPolicy"]["metricsFrom"]


def test_tls_and_api_key_are_wired_when_enabled():
    docs = render("tls")
    for doc, c in specdec_containers(docs):
        assert flag(c, "tls-cert") == "/etc/specdec/tls/tls.crt", c["name"]
        assert flag(c, "tls-key") == "/etc/specdec/tls/tls.key"
        assert flag(c, "tls-ca") == "/etc/specdec/tls/ca.crt"
        tls_volume = next(v for v in pod_spec(doc)["volumes"] if v["name"] == "tls")
        assert tls_volume["secret"]["secretName"] == "specdec-tls"
    gateway_doc = one(docs, "Deployment", f"{FULL}-gateway")
    gateway = container(gateway_doc, "gateway")
    # an Ingress in front (no client certificate): the gateway's own port does not require one
    assert flag(gateway, "tls-client-certs") == "optional"
    strict = render("tls", "--set", "tls.gatewayClientCerts=true")
    assert flag(container(one(strict, "Deployment", f"{FULL}-gateway"), "gateway"), "tls-client-certs") is None
    assert flag(gateway, "api-key-file") == "/etc/specdec/api-key/api-key"
    assert flag(gateway, "max-prompt-tokens") == "4096"
    secret = one(docs, "Secret", f"{FULL}-api-key")
    assert secret["data"]["api-key"] == "bm90LWEtcmVhbC1rZXk="  # base64("not-a-real-key")
    api_volume = next(v for v in pod_spec(gateway_doc)["volumes"] if v["name"] == "api-key")
    assert api_volume["secret"]["secretName"] == secret["metadata"]["name"]
    ingress = one(docs, "Ingress", f"{FULL}-gateway")
    assert ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["name"] == f"{FULL}-gateway"
    # nothing TLS-related when it is off
    assert "tls-cert" not in render_text("default") and "api-key" not in render_text("default")


# ---------- observability ----------


def test_tracing_points_every_service_at_the_bundled_jaeger():
    docs = render("tracing")
    jaeger = one(docs, "Service", f"{FULL}-jaeger")
    assert {"name": "otlp-grpc", "port": 4317} in [{k: p[k] for k in ("name", "port")} for p in jaeger["spec"]["ports"]]
    deployment = one(docs, "Deployment", f"{FULL}-jaeger")
    assert container(deployment, "jaeger")["image"].startswith("jaegertracing/jaeger:2.")
    names = set()
    for _, c in specdec_containers(docs):
        e = env(c)
        assert e["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == f"http://{FULL}-jaeger:4317"
        assert e["OTEL_TRACES_SAMPLER_ARG"]["value"] == "0.25"
        assert "OTEL_SDK_DISABLED" not in e
        names.add(e["OTEL_SERVICE_NAME"]["value"])
    assert names == {"specdec-gateway", "specdec-draft", "specdec-target"}
    # a registry's pull secret reaches the Jaeger pod too, as it does every other pod of the chart (QA)
    pulled = render("tracing", "--set", "imagePullSecrets[0].name=registry")
    assert pod_spec(one(pulled, "Deployment", f"{FULL}-jaeger"))["imagePullSecrets"] == [{"name": "registry"}]


def test_tracing_to_the_users_collector_and_off_by_default():
    endpoint = "http://jaeger-collector.observability:4317"
    docs = render("default", "--set", "tracing.enabled=true", "--set", f"tracing.otlpEndpoint={endpoint}")
    assert not find(docs, "Deployment", f"{FULL}-jaeger")
    for _, c in specdec_containers(docs):
        assert env(c)["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == endpoint
    for _, c in specdec_containers(render("default")):
        assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in env(c)
        assert env(c)["OTEL_SDK_DISABLED"]["value"] == "true"


def pods_selected(docs: list[dict], selector: dict) -> list[dict]:
    return [d for d in workloads(docs) if selector.items() <= pod_spec_labels(d).items()]


@pytest.mark.parametrize("case", ["default", "split"])
def test_metrics_services_reach_every_metrics_port(case):
    docs = render(case)
    metrics = [s for s in find(docs, "Service") if s["metadata"]["name"].endswith("-metrics")]
    assert sorted(s["metadata"]["labels"]["specdec/metrics"] for s in metrics) == ["draft", "gateway", "target"]
    for svc in metrics:
        annotations = svc["metadata"]["annotations"]
        port = svc["spec"]["ports"][0]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(port["port"])
        pods = pods_selected(docs, svc["spec"]["selector"])
        assert pods, svc["metadata"]["name"]
        for pod in pods:
            names = {p["name"]: p["containerPort"] for c in pod_spec(pod)["containers"] for p in c["ports"]}
            assert names.get(port["targetPort"]) == port["port"], (svc["metadata"]["name"], port)


def test_service_monitor_selects_the_metrics_services():
    docs = render("tracing")
    monitor = one(docs, "ServiceMonitor", FULL)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    # the series' own `service` label (gateway/draft/target) is what the docs' PromQL reads: the Operator's target
    # label of that name must not rename it `exported_service` (QA)
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True
    key = monitor["spec"]["selector"]["matchExpressions"][0]["key"]
    match = monitor["spec"]["selector"]["matchLabels"]
    selected = [
        s
        for s in find(docs, "Service")
        if key in s["metadata"]["labels"] and match.items() <= s["metadata"]["labels"].items()
    ]
    assert len(selected) == 3
    assert not find(render("default"), "ServiceMonitor")


# ---------- gateway extras, labels, services, helm test, notes ----------


def test_gateway_autoscaling_and_disruption_budget():
    docs = render("tracing")
    hpa = one(docs, "HorizontalPodAutoscaler", f"{FULL}-gateway")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{FULL}-gateway"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 8)
    assert "replicas" not in one(docs, "Deployment", f"{FULL}-gateway")["spec"], "the HPA owns the replica count"
    pdb = one(docs, "PodDisruptionBudget", f"{FULL}-gateway")
    assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"


@pytest.mark.parametrize("case, components", [("default", ["pair"]), ("split", ["draft", "target"]),
                                              ("colocated", ["pair"])])
def test_pairs_have_disruption_budgets_selecting_their_pods(case, components):
    """A node drain takes one pair Pod at a time (each loads for minutes); the budgets select the StatefulSets'
    Pods, and `maxUnavailable` must be a count or a percentage."""
    docs = render(case)
    for component in components:
        pdb = one(docs, "PodDisruptionBudget", f"{FULL}-{component}")
        sts = one(docs, "StatefulSet", f"{FULL}-{component}")
        selector = pdb["spec"]["selector"]["matchLabels"]
        assert selector.items() <= sts["spec"]["template"]["metadata"]["labels"].items()
        assert pdb["spec"]["maxUnavailable"] == 1
    assert not find(render(case, "--set", "pairs.podDisruptionBudget.enabled=false"), "PodDisruptionBudget",
                    f"{FULL}-{components[0]}")
    bad = run_helm(*template_args(case, "--set", "pairs.podDisruptionBudget.maxUnavailable=abc"), check=False)
    assert bad.returncode != 0 and "maxUnavailable" in bad.stderr


@pytest.mark.parametrize("case", VALUES_CASES)
def test_standard_labels_everywhere(case):
    for doc in render(case):
        labels = doc["metadata"]["labels"]
        for key in ("name", "instance", "version", "managed-by", "component", "part-of"):
            assert f"app.kubernetes.io/{key}" in labels, (doc["kind"], doc["metadata"]["name"], key)
        assert labels["helm.sh/chart"] == "specdec-0.1.0"


@pytest.mark.parametrize("case", VALUES_CASES)
def test_services_select_pods_with_the_named_ports(case):
    docs = render(case)
    for svc in find(docs, "Service"):
        pods = pods_selected(docs, svc["spec"]["selector"])
        assert pods, f"Service {svc['metadata']['name']} selects no pod"
        for port in svc["spec"]["ports"]:
            for pod in pods:
                names = {p["name"] for c in pod_spec(pod)["containers"] for p in c["ports"]}
                assert port["targetPort"] in names, (svc["metadata"]["name"], port["targetPort"])


def test_helm_test_hook_runs_a_short_generation():
    docs = render("default")
    pod = one(docs, "Pod", f"{FULL}-test-generate")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    c = pod["spec"]["containers"][0]
    assert c["args"][0] == "generate"
    assert flag(c, "addr") == f"{FULL}-gateway:50050"
    assert flag(c, "max-new-tokens") == "8"
    assert c["args"][-1] == "def fib(n):"
    assert pod["spec"]["restartPolicy"] == "Never"


def test_notes_show_port_forward_and_grpcurl():
    proc = run_helm("install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE)
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert f"port-forward svc/{FULL}-gateway 50050:50050" in notes
    assert "grpcurl -plaintext" in notes and "specdec.v1.GatewayService/Generate" in notes
    assert f"helm test {RELEASE}" in notes


def leaf_values(values: dict, prefix: str = "") -> list[str]:
    """Dotted paths of the leaves of values.yaml; free-form maps (resources, probes, contexts) count as leaves."""
    out = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and not re.search(r"(resources|Probe|[sS]ecurityContext)$", key):
            out += leaf_values(value, f"{path}.")
        else:
            out.append(path)
    return out


def test_readme_documents_every_value():
    readme = (CHART / "README.md").read_text()
    documented = set(re.findall(r"`([A-Za-z0-9_.]+)`", readme))
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    missing = [path for path in leaf_values(values) if path not in documented]
    assert not missing, f"values missing from deploy/helm/specdec/README.md: {missing}"



@pytest.mark.parametrize(("sets", "threshold", "configured"), [
    ((), 240, 180),  # 1800 s of target wait + 600: 40 min at 10 s
    (("draft.targetWaitSeconds=300",), 180, 180),  # the configured 30 min already covers 900 s
    (("draft.targetWaitSeconds=300", "draft.startupProbe.periodSeconds=5"), 180, 180),
    (("draft.startupProbe.failureThreshold=10", "draft.targetWaitSeconds=100"), 70, 10),
])
def test_a_drafts_startup_probe_covers_its_wait_for_the_target(sets, threshold, configured):
    """A draft's start is its wait for its target (--target-wait-seconds) plus its own load, calibration and graph
    capture: its startup probe allows at least the wait + 600 s, or the kubelet restarts it while it waits (QA);
    with pairing=colocated there is no wait: the configured probe."""
    args = [a for s in sets for a in ("--set", s)]
    draft = container(one(render("default", *args), "StatefulSet", f"{FULL}-pair"), "draft")
    assert draft["startupProbe"]["failureThreshold"] == threshold
    colocated = container(one(render("default", "--set", "pairing=colocated", *args), "StatefulSet", f"{FULL}-pair"),
                          "draft")
    assert colocated["startupProbe"]["failureThreshold"] == configured


@pytest.mark.parametrize(("sets", "wait"), [
    ((), "1800"),  # the target's start-up budget: 10 s x 180
    (("target.startupProbe.failureThreshold=360",), "3600"),
    (("target.startupProbe.periodSeconds=5", "target.startupProbe.failureThreshold=100"), "500"),
    (("target.startupProbe.failureThreshold=360", "draft.targetWaitSeconds=900"), "900"),  # set: as set
])
def test_a_draft_waits_for_its_target_as_long_as_the_target_may_take_to_start(sets, wait):
    """QA: raising only the target's startup budget (a large model) left the draft's wait at 30 minutes: it gave
    up, exited and came back with back-off. Unset, draft.targetWaitSeconds is the target's startup probe's
    periodSeconds x failureThreshold."""
    args = [a for s in sets for a in ("--set", s)]
    draft = container(one(render("default", *args), "StatefulSet", f"{FULL}-pair"), "draft")
    assert flag(draft, "target-wait-seconds") == wait
    probe = draft["startupProbe"]  # and the draft's own startup probe allows that wait + 600 s
    assert probe["periodSeconds"] * probe["failureThreshold"] >= int(wait) + 600
