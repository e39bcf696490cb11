"""Every command block of README.md, cluster/README.md and docs/ runs here, so none goes stale unseen.

A ```bash block runs in bash (`set -eo pipefail`, curl failing on an HTTP error) unless the line above its
fence says why it cannot run here: `<!-- not run by the tests: REASON -->` (it starts a server that runs
until stopped, needs other machines or programs, minutes of work, or it is a synopsis). A new block runs by
default. Blocks that talk to the documented server at http://127.0.0.1:8080 run against the test session's
tiny-glm app (configs/glm.yaml, served as `tiny`): the address is rewritten, and the name the documented
server answers to (`tiny-glm`) becomes the session's. (tests/app/test_docs.py checks that every fenced block
names its language, so a command cannot slip out of this test unlabelled.)
"""

import os
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.support.doc_blocks import REPO, Block, all_blocks

DOCUMENTED_SERVER = "http://127.0.0.1:8080"
DOCUMENTED_MODEL = '"model": "tiny-glm"'  # what `serve run configs/glm.yaml` serves the embedded model as
PREAMBLE = 'set -eo pipefail\ncurl() { command curl --fail-with-body "$@"; }\n'
BLOCK_TIMEOUT_S = 120
RUN = [block for block in all_blocks() if block.is_bash and block.skip is None]
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def documented_server(glm_base_url: str) -> str:
    """The session's tiny-glm app, as the pages' readers find theirs: it has answered a request already (the
    README's first one), so /metrics has a request to count."""
    body = {"messages": [{"role": "user", "content": "Hi"}]}
    reply = httpx.post(f"{glm_base_url}/v1/chat/completions", json=body, timeout=120)  # the app's first reply
    assert reply.status_code == 200, reply.text
    return glm_base_url


@pytest.mark.parametrize("block", RUN, ids=[block.name for block in RUN])
def test_each_bash_block_runs(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    script = block.body
    if DOCUMENTED_SERVER in script:
        server = request.getfixturevalue("documented_server")
        script = script.replace(DOCUMENTED_SERVER, server).replace(DOCUMENTED_MODEL, '"model": "tiny"')
    env = {**os.environ, "HOME": str(tmp_path)}  # a block writes nothing of the user's
    command = ["bash", "-c", PREAMBLE + script]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    assert done.returncode == 0 and done.stdout.strip(), f"{block.name}:\n{script}\n{done.stdout}\n{done.stderr}"
