"""engine.models.spec reads a checkpoint's facts without torch, and agrees with transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import ARCHS
from engine.models.loader import load_hf_config
from engine.models.spec import load_model_spec, model_spec_from_config, read_config


@pytest.mark.parametrize("arch", ARCHS)
def test_raw_config_spec_equals_transformers_config_spec(arch: str, ckpt_dir: Callable[..., Path]) -> None:
    path = str(ckpt_dir(arch))
    assert model_spec_from_config(read_config(path)) == model_spec_from_config(load_hf_config(path))


def test_legacy_rope_fields_are_normalised(tmp_path: Path, ckpt_dir: Callable[..., Path]) -> None:
    raw = read_config(str(ckpt_dir("llama")))
    raw.pop("rope_parameters", None)
    raw["rope_theta"] = 500000.0
    raw["rope_scaling"] = {"type": "dynamic", "factor": 2.0}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not supported"):
        load_model_spec(str(tmp_path))


def test_reading_a_spec_and_tokenizer_does_not_import_torch() -> None:
    code = (
        "import sys; from engine.models.spec import load_model_spec, load_tokenizer;"
        "load_model_spec('models/target'); load_tokenizer('models/target');"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
