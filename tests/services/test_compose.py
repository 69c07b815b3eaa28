"""compose.yaml agrees with the CLI: services, commands, env (each a real flag), ports, health."""

import argparse
from pathlib import Path

import pytest
import yaml

from splitserve.cli import build_parser
from plumbing.config import env_name

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _env_flags(sub: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {env_name(a.option_strings[0]): a for a in sub._actions if a.option_strings and a.option_strings[0].startswith("--")}


def test_services_and_commands(compose: dict) -> None:
    services = compose["services"]
    assert set(services) == {"gateway", "prefill", "decode"}
    subs = _subparsers()
    for name, svc in services.items():
        assert svc["command"][0] == name and name in subs
        assert "image" in svc
    assert "build" in services["gateway"]


def test_every_env_var_is_a_flag_of_its_command_and_parses(compose: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    subs = _subparsers()
    for name, svc in compose["services"].items():
        flags = _env_flags(subs[name])
        env = {k: str(v) for k, v in svc["environment"].items()}
        unknown = sorted(set(env) - set(flags) - {"SPLITSERVE_MODEL"} | ({"SPLITSERVE_MODEL"} - set(flags)))
        assert unknown == [], f"{name}: env vars with no matching flag: {unknown}"
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        args = build_parser().parse_args([name])
        for key, value in env.items():
            dest = flags[key].dest
            expected = flags[key].type(value) if flags[key].type else value
            assert getattr(args, dest) == expected, (name, key)
        for key in env:
            monkeypatch.delenv(key)


def test_ports_health_checks_and_wiring(compose: dict) -> None:
    services = compose["services"]
    gw_port = services["gateway"]["environment"]["SPLITSERVE_PORT"]
    assert f"{gw_port}:{gw_port}" in services["gateway"]["ports"]
    for name, svc in services.items():
        env = svc["environment"]
        port = env["SPLITSERVE_PORT"]
        test = svc["healthcheck"]["test"]
        assert test[:3] == ["CMD", "splitserve", "health"] and test[-1] == f"127.0.0.1:{port}"
        assert env["SPLITSERVE_HOST"] == "0.0.0.0"
        metrics = env["SPLITSERVE_METRICS_PORT"]
        assert any(str(p).startswith(f"{metrics}:") for p in svc["ports"])
        if name != "gateway":
            internal = services["gateway"]["environment"]["SPLITSERVE_INTERNAL_PORT"]
            assert env["SPLITSERVE_GATEWAY"] == f"gateway:{internal}"  # the registry: never the public port
            assert not any(str(p).startswith(f"{internal}:") for p in services["gateway"]["ports"])
            assert env["SPLITSERVE_ADVERTISE_HOST"] == name
            # The gateway is healthy only once a decode worker registered: workers must not wait for it.
            assert svc["depends_on"]["gateway"]["condition"] == "service_started"
            devices = svc["deploy"]["resources"]["reservations"]["devices"]
            assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
            assert env["SPLITSERVE_TRANSPORT"] == "nccl" and env["SPLITSERVE_DEVICE"] == "cuda"


def test_dockerfile_installs_the_package_and_builds_protos() -> None:
    text = (ROOT / "Dockerfile").read_text()
    # The build stage makes the wheel (kernels compiled against the image's torch), the image installs it.
    assert "pip wheel --no-build-isolation --no-deps -w /wheels ." in text and "pip install /wheels/" in text
    assert "splitserve.v1.gateway_pb2_grpc" in text and "native_kernels" in text
    for path in ("protos", "engine", "kernels", "gateway", "prefill_worker", "decode_worker", "splitserve", "models"):
        assert f"COPY {path} ./{path}" in text
    assert 'ENTRYPOINT ["splitserve"]' in text


def test_the_image_runs_as_non_root_with_a_healthcheck() -> None:
    lines = [line.split() for line in (ROOT / "Dockerfile").read_text().splitlines() if line.strip()]
    users = [words[1] for words in lines if words[0] == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    text = (ROOT / "Dockerfile").read_text()
    assert "SPLITSERVE_HEALTH_PORT=8081" in text
    assert 'CMD ["splitserve", "health", "--plaintext"]' in text


def test_the_image_fetches_the_default_model_that_compose_serves(compose: dict) -> None:
    from splitserve.default_model import FILE_NAME

    text = (ROOT / "Dockerfile").read_text()
    assert "ENV SPLITSERVE_CACHE=/app/cache" in text and "RUN splitserve fetch" in text
    assert f"SPLITSERVE_MODEL=/app/cache/{FILE_NAME}" in text
    for svc in compose["services"].values():
        assert svc["environment"]["SPLITSERVE_MODEL"] == f"/app/cache/{FILE_NAME}"
