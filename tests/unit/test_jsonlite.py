"""core/jsonlite.py: the standard library's json, or the hook's codec (hook/fastjson.py: `_json` without
the json package); both give the same text and values and refuse the same documents."""

import json
import math

import pytest

from devinject.core import jsonlite
from devinject.hook import fastjson


@pytest.fixture(params=["json", "fastjson"], autouse=True)
def codec(request):
    before = jsonlite._loads, jsonlite._dumps
    if request.param == "fastjson":
        fastjson.install()
    else:
        jsonlite.install(jsonlite.stdlib_loads, jsonlite.stdlib_dumps)
    yield request.param
    jsonlite.install(*before)

DOCS = [
    {"ociVersion": "1.0.2", "id": "c1", "pid": 42, "annotations": {"cdi.k8s.io/x": "a.com/b=c,d"}},
    [1, -2, 3.5, 1e100, -0.0, True, False, None, "é\u2028\n\t\"\\", {"": []}],
    {"nested": {"deep": [[[{"k": "v"}]]]}, "unicode": "日本", "big": 2**70},
    "plain", 0, [],
]


@pytest.mark.parametrize("doc", DOCS)
def test_round_trip_matches_stdlib(doc):
    for sort_keys in (False, True):
        text = jsonlite.dumps(doc, sort_keys=sort_keys)
        assert text == json.dumps(doc, sort_keys=sort_keys)
        assert jsonlite.loads(text) == doc
        assert jsonlite.loads(text.encode()) == doc


@pytest.mark.parametrize("text", ["", "{", '{"a": 1} x', "[1,]", "NaN", '{"a": Infinity}', "\ufeff{}", "nul",
                                  "1e400", '{"t": -1e999}'])
def test_invalid_documents_raise_value_error(text):
    with pytest.raises(ValueError):
        jsonlite.loads(text)


def test_whitespace_around_a_document_is_fine():
    assert jsonlite.loads(' \n {"a": [1, 2]} \n\t') == {"a": [1, 2]}


def test_non_serialisable_and_nan_are_refused():
    with pytest.raises(TypeError):
        jsonlite.dumps({"a": object()})
    with pytest.raises(ValueError):
        jsonlite.dumps(math.nan)


def test_the_codec_in_use_does_the_work(codec):
    assert (jsonlite._loads is fastjson.loads) == (codec == "fastjson")



def test_a_circular_structure_is_a_value_error():
    loop: list[object] = []
    loop.append(loop)
    with pytest.raises(ValueError):
        jsonlite.dumps(loop)
