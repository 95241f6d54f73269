from __future__ import annotations

import pytest

from tests.e2e.stack import TestStack


@pytest.fixture(scope="module")
def stack(tmp_path_factory, request):
    env = getattr(request.module, "STACK_ENV", {})
    s = TestStack(tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1]), **env)
    try:
        s.start(learning=getattr(request.module, "STACK_LEARNING", False))
    except Exception:
        s.stop()
        raise
    yield s
    failed = request.session.testsfailed
    s.stop()
    if failed:
        for name in s.procs:
            print(s.tail(name, 60))
