"""compose.yaml agrees with the CLI: services, commands, env (each a real flag), ports, health."""

import argparse
from pathlib import Path

import pytest
import yaml

from splitserve.cli import build_parser
from plumbing.config import env_name

ROOT = Path(__file__).resolve().parents[2]
GATEWAYS = ("gateway", "gateway-2")  # two replicas (docs/architecture.md, "Gateway replicas")


def _role(name: str) -> str:
    return "gateway" if name in GATEWAYS else name


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
    assert set(services) == {*GATEWAYS, "prefill", "decode"}
    subs = _subparsers()
    for name, svc in services.items():
        assert svc["command"][0] == _role(name) and _role(name) in subs
        assert "image" in svc
    assert "build" in services["gateway"]


def test_every_env_var_is_a_flag_of_its_command_and_parses(compose: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    subs = _subparsers()
    for name, svc in compose["services"].items():
        flags = _env_flags(subs[_role(name)])
        env = {k: str(v) for k, v in svc["environment"].items()}
        unknown = sorted(set(env) - set(flags) - {"SPLITSERVE_MODEL"} | ({"SPLITSERVE_MODEL"} - set(flags)))
        assert unknown == [], f"{name}: env vars with no matching flag: {unknown}"
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        args = build_parser().parse_args([_role(name)])
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
    published = [str(p).split(":")[0] for g in GATEWAYS for p in services[g]["ports"]]
    assert len(published) == len(set(published))  # each replica on its own host ports
    for name, svc in services.items():
        env = svc["environment"]
        port = env["SPLITSERVE_PORT"]
        test = svc["healthcheck"]["test"]
        assert test[:3] == ["CMD", "splitserve", "health"] and test[-1] == f"127.0.0.1:{port}"
        assert env["SPLITSERVE_HOST"] == "0.0.0.0"
        metrics = env["SPLITSERVE_METRICS_PORT"]
        assert any(str(p).endswith(f":{metrics}") for p in svc["ports"])
        if name not in GATEWAYS:
            internal = services["gateway"]["environment"]["SPLITSERVE_INTERNAL_PORT"]
            # Every replica's registry (never the public port), kept off the host.
            assert env["SPLITSERVE_GATEWAY"] == ",".join(f"{g}:{internal}" for g in GATEWAYS)
            for g in GATEWAYS:
                assert not any(str(p).endswith(f":{internal}") for p in services[g]["ports"])
                # A gateway is healthy only once a decode worker registered: workers must not wait for it.
                assert svc["depends_on"][g]["condition"] == "service_started"
            assert env["SPLITSERVE_ADVERTISE_HOST"] == name
            devices = svc["deploy"]["resources"]["reservations"]["devices"]
            assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
            assert env["SPLITSERVE_TRANSPORT"] == "nccl" and env["SPLITSERVE_DEVICE"] == "cuda"


def test_every_service_ships_authenticated(compose: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The internal secret from a compose secret (the environment of `compose up`), on every
    service; what the services build from their variables passes the start-up check (an
    internal port on 0.0.0.0 without authentication would refuse to start)."""
    from plumbing.config import server_config

    assert compose["secrets"]["internal-secret"] == {"environment": "SPLITSERVE_INTERNAL_SECRET"}
    for name, svc in compose["services"].items():
        assert svc["secrets"] == ["internal-secret"], name
        env = svc["environment"]
        assert env["SPLITSERVE_INTERNAL_SECRET_FILE"] == "/run/secrets/internal-secret", name
        assert "SPLITSERVE_INSECURE_INTERNAL" not in env and "SPLITSERVE_INTERNAL_SECRET" not in env
        for key, value in env.items():
            monkeypatch.setenv(key, str(value))
        config = server_config(build_parser().parse_args([_role(name)]))
        assert config.host == "0.0.0.0" and config.security.authenticates_internal
        for key in env:
            monkeypatch.delenv(key)


def test_dockerfile_installs_the_package_and_builds_protos() -> None:
    text = (ROOT / "Dockerfile").read_text()
    # The build stage makes the wheel (kernels compiled against the image's torch), the image installs it.
    assert "pip wheel --no-build-isolation --no-deps -w /wheels ." in text and "pip install /wheels/" in text
    assert "splitserve_api.v1.gateway_pb2_grpc" in text and "native_kernels" in text
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
