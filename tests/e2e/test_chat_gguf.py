"""A GGUF checkpoint through the split path, with chat requests: gateway (torch-free GGUF
tokenizer and chat template) -> prefill worker -> Gloo -> decode worker, both loading the
Q8_0 file; the stream equals the in-process engine on the same file."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.chat import ChatTemplate
from splitserve.client import make_chat_request
from splitserve.cluster import Cluster
from splitserve_api.v1 import common_pb2
from tests.e2e.cluster_util import ROOT, stream, stream_many, wait_all_free
from tests.engine.gguf_files import checkpoint_to_gguf

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("cluster_gguf")]

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant: {% endif %}")
CHATS = [[("user", "Write a function that adds two numbers.")],
         [("system", "You write Python."), ("user", "Read a file and count its lines.")]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gguf") / "target.Q8_0.gguf"
    return checkpoint_to_gguf(ROOT / "models" / "target", out, qtype="Q8_0", chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def cluster(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    with Cluster(str(model), num_prefill=1, num_decode=1, log_dir=str(tmp_path_factory.mktemp("logs-gguf")),
                 gateway_flags=["--local-prefill-max-tokens", "0"]) as c:
        yield c


def test_chat_streams_what_the_engine_answers(model: Path, cluster: Cluster) -> None:
    engine = Engine(EngineConfig(model=str(model), num_threads=1))
    chat = ChatTemplate.of(engine.tokenizer)
    assert chat is not None and chat.end_of_turn_ids == (engine.tokenizer.convert_tokens_to_ids("</s>"),)
    params = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=chat.end_of_turn_ids)
    want = engine.generate([chat.render(turns) for turns in CHATS], params)
    got = stream_many(cluster.addresses["gateway"], [make_chat_request(turns, 24) for turns in CHATS])
    for g, w in zip(got, want):
        assert g.error is None, g.details
        assert g.token_ids == w.token_ids and g.text == w.text and g.text
        reason = common_pb2.FINISH_REASON_STOP if w.finish_reason == "stop" else common_pb2.FINISH_REASON_LENGTH
        assert g.finish_reason == reason
        assert g.timings.transfer_bytes > 0  # prefilled remotely, pages shipped over Gloo
    assert all(s.kv_blocks_free == s.kv_blocks_total for s in wait_all_free(cluster.addresses["gateway"]).values())


def test_text_prompts_still_work_on_a_gguf_model(cluster: Cluster) -> None:
    from splitserve.client import make_request

    res = stream(cluster.addresses["gateway"], make_request("def add(a, b):", 8))
    assert res.error is None and len(res.token_ids) == 8
