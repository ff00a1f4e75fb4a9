"""The engine launcher turns settings into vLLM's command line and environment."""

import json
from pathlib import Path

import pytest

from appliance.engine_launch import python, serves_adapters
from appliance.errors import SettingsError
from appliance.home import Home
from appliance.records import Gpu, Host, Plan
from appliance.settings import EngineSettings, PoolSettings, Settings
from serve.engine import build_launch, engine_programs
from tests.support.plans import plan_file


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def gpu_host(count: int) -> Host:
    """An all-NVLink host whose first half of GPUs sits on NUMA node 0, the rest on node 1."""
    return Host(name="gpu-1", nvlink_all_to_all=True, numa_cpus={0: "0-15", 1: "16-31"},
                gpus=[Gpu(index=i, name="H100", memory_bytes=80 * 2**30, numa_node=0 if i < count // 2 else 1)
                      for i in range(count)])


def test_cpu_demo_pool(home: Home) -> None:
    settings = Settings(engine=EngineSettings(device="cpu"))
    launch = build_launch(settings.pools[0], settings, home, api_key="k")
    argv = launch.argv
    assert argv[:4] == [python(), "-P", "-m", "serve.vllm_rank"]
    assert flag(argv, "--model") == str(home.demo_model)
    assert flag(argv, "--served-model-name") == "SmolLM2-135M-Instruct"
    assert flag(argv, "--uds") == str(home.run / "engines" / "main.sock") and "--port" not in argv
    assert flag(argv, "--dtype") == "float32" and flag(argv, "--max-model-len") == "2048"
    assert flag(argv, "--gpu-memory-utilization") == "0.3"
    assert "--enforce-eager" in argv
    # Adapters are served by default (pools.NAME.enable_lora), loaded at run time.
    assert "--enable-lora" in argv and flag(argv, "--max-lora-rank") == "16" and flag(argv, "--max-loras") == "4"
    assert launch.environment["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert launch.environment["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert launch.environment["VLLM_API_KEY"] == "k"
    assert "k" not in argv, "the API key must not appear on the command line"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in launch.environment


def moe_model(directory: Path, **experts: int) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"architectures": ["Qwen3MoeForCausalLM"], **experts}))
    return directory


@pytest.mark.parametrize("experts", [{"num_experts": 4}, {"num_local_experts": 8}, {"n_routed_experts": 256}])
def test_a_mixture_of_experts_on_the_cpu_engine_serves_no_adapters_unless_told(home: Home, tmp_path: Path,
                                                                               experts: dict[str, int]) -> None:
    """vLLM's fused-MoE LoRA needs Triton's GPU kernels: on the CPU engine a MoE pool with adapters on
    starts, then dies on its first request. Unset, enable_lora leaves them off there, and says so by
    what it launches; on a GPU, or set, it is as set."""
    moe = moe_model(tmp_path / "moe", **experts)
    cpu = Settings(engine=EngineSettings(device="cpu"), pools=[PoolSettings(name="main", model=str(moe))])
    assert not serves_adapters(cpu.pools[0], cpu, home)
    assert "--enable-lora" not in build_launch(cpu.pools[0], cpu, home, api_key="k").argv
    told = cpu.model_copy(update={"pools": [PoolSettings(name="main", model=str(moe), enable_lora=True)]})
    assert serves_adapters(told.pools[0], told, home)
    gpu = Settings(engine=EngineSettings(device="cuda"), pools=[PoolSettings(name="main", model=str(moe))])
    assert serves_adapters(gpu.pools[0], gpu, home)
    dense = Settings(engine=EngineSettings(device="cpu"))
    assert serves_adapters(dense.pools[0], dense, home), "the demo model is dense"


def test_a_pool_told_not_to_serve_adapters_starts_without_lora(home: Home) -> None:
    settings = Settings(engine=EngineSettings(device="cpu"), pools=[PoolSettings(name="main", enable_lora=False)])
    launch = build_launch(settings.pools[0], settings, home, api_key="k")
    assert "--enable-lora" not in launch.argv and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in launch.environment


def test_the_engine_logs_at_info_whatever_its_parent_imported(home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    """Importing TRL sets VLLM_LOGGING_LEVEL=ERROR in the importer's environment; the engine's own
    environment names INFO, so its start and loader lines are logged wherever it was launched from."""
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "ERROR")
    settings = Settings(engine=EngineSettings(device="cpu"))
    assert build_launch(settings.pools[0], settings, home, api_key="k").environment["VLLM_LOGGING_LEVEL"] == "INFO"


def test_cuda_pool_with_parallelism_and_lora(tmp_path: Path, home: Home) -> None:
    pool = PoolSettings(name="full", model=str(tmp_path / "Big-Model"),
                        tensor_parallel_size=8, pipeline_parallel_size=2, data_parallel_size=1,
                        enable_expert_parallel=True, enable_lora=True, max_lora_rank=64,
                        max_model_len=32768, extra_args=["--kv-cache-dtype", "fp8"])
    settings = Settings(engine=EngineSettings(device="cuda"), pools=[pool])
    launch = build_launch(pool, settings, home, api_key="k")
    argv = launch.argv
    assert flag(argv, "--served-model-name") == "Big-Model"
    assert flag(argv, "--tensor-parallel-size") == "8"
    assert flag(argv, "--pipeline-parallel-size") == "2"
    assert "--enable-expert-parallel" in argv
    assert flag(argv, "--max-lora-rank") == "64" and "--enable-lora" in argv
    assert flag(argv, "--max-model-len") == "32768"
    assert flag(argv, "--gpu-memory-utilization") == "0.9" and flag(argv, "--dtype") == "bfloat16"
    assert "--enforce-eager" not in argv
    assert argv[-2:] == ["--kv-cache-dtype", "fp8"]
    assert launch.environment["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert not any(key.startswith("VLLM_CPU") for key in launch.environment)


def test_cpu_tensor_parallel_binds_cores_per_rank(home: Home) -> None:
    pool = PoolSettings(name="tp", tensor_parallel_size=2)
    settings = Settings(engine=EngineSettings(device="cpu"), pools=[pool])
    bind = build_launch(pool, settings, home, api_key="k").environment["VLLM_CPU_OMP_THREADS_BIND"]
    assert bind.count("|") == 1


def test_programs_report_missing_model(home: Home) -> None:
    [program] = engine_programs(Settings(engine=EngineSettings(device="cpu")), home)
    assert program.name == "vllm-main" and program.pool == "main" and program.port is None
    assert program.socket == home.run / "engines" / "main.sock" and program.health_url == "http://engine/health"
    assert program.command[program.command.index("--uds") + 1] == str(program.socket)
    assert "--port" not in program.command and "--host" not in program.command
    assert program.missing is not None and "no config.json" in program.missing
    assert "prepare-demo" in program.missing


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_programs_ready_when_model_present(home: Home, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("serve.engine.local_host", lambda: gpu_host(1))
    home.demo_model.mkdir(parents=True)
    (home.demo_model / "config.json").write_text("{}")
    (home.demo_model / "model.safetensors").write_bytes(b"")
    [program] = engine_programs(Settings(engine=EngineSettings(device=device)), home)
    assert program.missing is None


def test_gateway_never_imports_from_the_state_dir(home: Home) -> None:
    """Regression: uvicorn puts its working directory, the state dir, first on
    sys.path by default, and the state dir's audit/ folder then shadowed the audit package on
    every gateway restart."""
    from serve.programs import gateway_program

    command = gateway_program(Settings(), home).command
    # -P keeps the working directory off sys.path; serve.listener runs uvicorn without an app dir.
    assert command[1:] == ["-P", "-m", "serve.listener"]


@pytest.mark.integration
def test_pool_launches_the_layout_of_its_plan(tmp_path: Path, home: Home) -> None:
    plan = plan_file(home.root, "mixtral-8x22b", "1x8xH100-80GB", "--context", "16384", "--tp", "8")
    pool = PoolSettings(name="main", model=str(tmp_path / "Mixtral"), plan=str(plan), tensor_parallel_size=1)
    settings = Settings(engine=EngineSettings(device="cuda"), pools=[pool])
    argv = build_launch(pool, settings, home, api_key="k").argv
    record = json.loads(plan.read_text())
    assert flag(argv, "--tensor-parallel-size") == "8" == str(record["layout"]["tp"])
    assert flag(argv, "--pipeline-parallel-size") == str(record["layout"]["pp"])
    assert flag(argv, "--max-model-len") == "16384"


@pytest.mark.integration
@pytest.mark.parametrize("model,hardware,problem", [
    ("llama-3.1-405b", "2x8xH100-80GB", "the plan spans 2 hosts, but cluster.bind is unset"),
    ("llama-3.1-405b", "1x8xH100-80GB", "the plan found no feasible layout"),
])
def test_unusable_plans_are_refused(home: Home, model: str, hardware: str, problem: str) -> None:
    pool = PoolSettings(name="main", plan=str(plan_file(home.root, model, hardware)))
    with pytest.raises(SettingsError, match=problem):
        build_launch(pool, Settings(pools=[pool]), home, api_key="k")


def test_broken_plan_file_is_named(tmp_path: Path, home: Home) -> None:
    broken = tmp_path / "plan.json"
    broken.write_text('{"feasible": true}')
    pool = PoolSettings(name="main", plan=str(broken))
    with pytest.raises(SettingsError, match=r"pools.main.plan: .*plan.json: not a plan record: model: Field required"):
        build_launch(pool, Settings(pools=[pool]), home, api_key="k")
    pool = PoolSettings(name="main", plan=str(tmp_path / "absent.json"))
    with pytest.raises(SettingsError, match="cannot read the plan"):
        build_launch(pool, Settings(pools=[pool]), home, api_key="k")


@pytest.mark.integration
def test_the_printed_launch_is_what_the_launcher_runs(home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    """`appliance plan` prints each host's launch through the launcher's own function: a pool
    naming the plan runs exactly that argv, on the GPUs the plan chose."""
    home.settings_file.write_text('[engine]\ndevice = "cuda"\n[[pools]]\nname = "full"\n'
                                  'enable_lora = true\nextra_args = ["--kv-cache-dtype", "fp8"]\n')
    path = plan_file(home.root, "mixtral-8x22b", "1x8xH100-80GB", "--context", "16384", "--tp", "4", "--pp", "1",
                     "--dp", "1", "--pool", "full")
    printed = Plan.model_validate_json(path.read_text())
    [head] = printed.commands
    model = str(Path(__file__).parent.parent / "data" / "model_configs" / "mixtral-8x22b.json")
    pool = PoolSettings(name="full", model=model, plan=str(path), enable_lora=True,
                        extra_args=["--kv-cache-dtype", "fp8"])
    settings = Settings(engine=EngineSettings(device="cuda", isolate_network=False), pools=[pool])
    monkeypatch.setattr("serve.engine.local_host", lambda: gpu_host(8))
    [program] = engine_programs(settings, home)
    assert head.gpus == program.gpus == [0, 1, 2, 3]
    assert program.command == ["taskset", "-c", "0-15", *head.argv], "bound to the GPUs' NUMA node"
    assert {**head.env, "VLLM_API_KEY": program.environment["VLLM_API_KEY"]} == program.environment
    assert flag(head.argv, "--uds") == str(home.run / "engines" / "full.sock") and "--enable-lora" in head.argv


def test_pools_on_gpus_get_disjoint_sets(home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("serve.engine.local_host", lambda: gpu_host(8))
    pools = [PoolSettings(name="full", tier="full", tensor_parallel_size=4),
             PoolSettings(name="fast", tier="fast", gpus=[4]),
             PoolSettings(name="small", tier="small", tensor_parallel_size=2)]
    programs = engine_programs(Settings(engine=EngineSettings(device="cuda"), pools=pools), home)
    sets = {p.pool: p.gpus for p in programs}
    assert sets == {"full": [0, 1, 2, 3], "fast": [4], "small": [5, 6]}
    for program in programs:
        assert program.environment["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, program.gpus))
    clash = [PoolSettings(name="full", tier="full", gpus=[0, 1], tensor_parallel_size=2),
             PoolSettings(name="fast", tier="fast", gpus=[1])]
    with pytest.raises(SettingsError, match="pools full and fast both hold GPU 1 on gpu-1"):
        engine_programs(Settings(engine=EngineSettings(device="cuda"), pools=clash), home)
    with pytest.raises(SettingsError, match="pools.fast.gpus: the CPU engine uses no GPUs"):
        engine_programs(Settings(engine=EngineSettings(device="cpu"), pools=[PoolSettings(name="fast", gpus=[0])]),
                        home)


def test_replicas_are_engines_of_their_own_on_gpus_of_their_own(home: Home,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool's replicas run as programs vllm-<pool>, vllm-<pool>_1, ... each on its own
    socket and GPU set (given GPUs split in order, else chosen); overlaps are refused at `up`."""
    monkeypatch.setattr("serve.engine.local_host", lambda: gpu_host(8))
    pools = [PoolSettings(name="full", tier="full", tensor_parallel_size=2, replicas=2, gpus=[4, 5, 6, 7]),
             PoolSettings(name="fast", tier="fast", replicas=3)]
    programs = engine_programs(Settings(engine=EngineSettings(device="cuda"), pools=pools), home)
    placed = {p.name: (p.pool, p.gpus, p.environment["CUDA_VISIBLE_DEVICES"]) for p in programs}
    assert placed == {"vllm-full": ("full", [4, 5], "4,5"), "vllm-full_1": ("full", [6, 7], "6,7"),
                      "vllm-fast": ("fast", [0], "0"), "vllm-fast_1": ("fast", [1], "1"),
                      "vllm-fast_2": ("fast", [2], "2")}
    sockets = {p.name: flag(p.command, "--uds") for p in programs}
    assert len(set(sockets.values())) == 5 and sockets["vllm-full_1"].endswith("/full_1.sock")
    cuda = EngineSettings(device="cuda")
    overlapping = [PoolSettings(name="full", tier="full", replicas=2, gpus=[0, 1]),
                   PoolSettings(name="fast", tier="fast", gpus=[1])]
    with pytest.raises(SettingsError, match="pools full_1 and fast both hold GPU 1 on gpu-1"):
        engine_programs(Settings(engine=cuda, pools=overlapping), home)
    short = [PoolSettings(name="full", replicas=2, tensor_parallel_size=2, gpus=[0, 1])]
    with pytest.raises(SettingsError, match="pools.full.gpus: 2 GPUs given; pool full runs 2 replica"):
        engine_programs(Settings(engine=cuda, pools=short), home)
    untiered = [PoolSettings(name="full", tier="full"), PoolSettings(name="other")]
    with pytest.raises(SettingsError, match="pools.other.tier: pools full and other both serve"):
        engine_programs(Settings(engine=cuda, pools=untiered), home)
    same = [PoolSettings(name="a", tier="fast"), PoolSettings(name="b", tier="fast")]
    with pytest.raises(SettingsError, match="pools a and b both serve .* as tier 'fast'"):
        engine_programs(Settings(engine=cuda, pools=same), home)
    two_models = [PoolSettings(name="a"), PoolSettings(name="b", served_model_name="other")]
    assert len(engine_programs(Settings(engine=cuda, pools=two_models), home)) == 2


@pytest.mark.integration
def test_a_pool_spanning_hosts_runs_its_head_rank_for_the_controller(tmp_path: Path, home: Home,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 of a plan over two hosts, started by the cluster controller (not by `up`),
    in the host's network (the other ranks reach it over the cluster network)."""
    monkeypatch.setattr("serve.engine.local_host", lambda: gpu_host(8))
    plan = plan_file(home.root, "llama-3.1-405b", "2x8xH100-80GB")
    pool = PoolSettings(name="big", model=str(tmp_path / "Llama"), plan=str(plan))
    settings = Settings.model_validate({"engine": {"device": "cuda"}, "cluster": {"bind": "10.9.0.1"},
                                        "pools": [pool.model_dump()]})
    [program] = engine_programs(settings, home)
    assert not program.autostart and program.command[0] != "unshare"
    argv = program.command[program.command.index("-P") - 1:]
    assert flag(argv, "--nnodes") == "2" and flag(argv, "--node-rank") == "0"
    assert flag(argv, "--master-addr") == "10.9.0.1" and "--headless" not in argv
    assert program.environment["VLLM_HOST_IP"] == "10.9.0.1" and program.gpus == list(range(8))


def test_a_chatml_model_is_served_with_tool_calling_and_the_template_written_for_it(
        home: Home, demo_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo model (a Llama whose ChatML template shows no tools), told hermes: the appliance's
    template, written where the head's arguments name it; by default, the engine gets neither."""
    import shutil

    shutil.copytree(demo_model, home.demo_model, ignore=shutil.ignore_patterns("*.safetensors"))
    (home.demo_model / "model.safetensors").write_bytes(b"")
    told = Settings(engine=EngineSettings(device="cpu"), pools=[PoolSettings(name="main", tool_parser="hermes")])
    [program] = engine_programs(told, home)
    argv = program.command
    assert "--enable-auto-tool-choice" in argv and flag(argv, "--tool-call-parser") == "hermes"
    template = Path(flag(argv, "--chat-template"))
    assert template == home.run / "engines" / "main.chat-template.jinja"
    assert "<tools>" in template.read_text() and (template.stat().st_mode & 0o777) == 0o644
    [program] = engine_programs(Settings(engine=EngineSettings(device="cpu")), home)
    assert "--enable-auto-tool-choice" not in program.command and "--chat-template" not in program.command
