"""The chat page `triforce serve` gives at `/`, in headless Chromium: it names the model and
method, streams an answer, keeps the conversation (the second turn's prompt is mostly reused KV),
stops an answer (the row stops too), renders code blocks as code and a user's markup as text, and
asks for the key of a server that wants one. The page is served under the Host policy like the API."""
import json

import httpx
import pytest

from headless_chromium import Browser, chromium
from serve_helpers import LiveServer, wait_for

pytestmark = pytest.mark.skipif(chromium() is None, reason="needs Debian's chromium (apt-get install chromium; "
                                                           ".ci/run installs it)")


@pytest.fixture(scope="module")
def browser():
    b = Browser()
    yield b
    b.close()


@pytest.fixture(scope="module")
def server(default_model_dir):
    live = LiveServer(str(default_model_dir), max_context=1024, batch_size=1)
    yield live
    live.stop()


def ask(browser, text: str) -> None:
    browser.js(f"document.getElementById('prompt').value = {json.dumps(text)}")
    browser.js("document.getElementById('send').click()")


ANSWERS = "document.querySelectorAll('.msg.assistant')"


def test_the_page_streams_answers_keeps_the_conversation_and_stops(browser, server):
    browser.open(server.url + "/?temperature=0")  # greedy, so the answer is known
    info = browser.wait("document.getElementById('info').textContent.startsWith('method') && "
                        "document.getElementById('info').textContent")
    assert info.startswith("method ") and "1024-token context" in info and "temperature 0," in info
    assert "repeat_penalty 1.1" in info  # the server's defaults for the fields the address leaves out
    assert browser.js("document.getElementById('model').textContent") == server.api.model_id
    ask(browser, "What is the capital of France? Answer in one sentence.")
    first = browser.wait(f"{ANSWERS}[0].dataset.state && {ANSWERS}[0].textContent")
    assert "Paris" in first and "done:" in first and "tok/s" in first
    ask(browser, "And of Italy?")
    second = browser.wait(f"{ANSWERS}[1] && {ANSWERS}[1].dataset.state && {ANSWERS}[1].textContent")
    reused, prompt = map(int, second.split(", ")[1].split(" prompt tokens")[0].split(" of "))
    assert "done:" in second and reused > prompt // 2  # the first turn's KV went on serving
    ask(browser, "Write a long story about a lighthouse keeper and the sea, in many chapters.")
    browser.wait(f"{ANSWERS}[2] && {ANSWERS}[2].querySelector('.body').textContent.length > 0")
    browser.js("document.getElementById('stop').click()")
    stopped = browser.wait(f"{ANSWERS}[2].dataset.state && {ANSWERS}[2].textContent")
    assert "stopped:" in stopped
    wait_for(lambda: server.scheduler.running == 0, "the stopped row to end", deadline_s=30)
    assert browser.js("document.getElementById('send').disabled") is False


def test_code_is_rendered_as_code_and_markup_as_text(browser, server):
    browser.open(server.url + "/")
    html = browser.js("""(() => { const d = document.createElement('div');
        render(d, 'Run this:\\n```python\\nprint(1 < 2)\\n```\\n<b>not bold</b><script>x()</script>');
        return d.innerHTML; })()""")
    assert '<pre><code data-lang="python">print(1 &lt; 2)\n</code></pre>' in html
    assert "&lt;b&gt;not bold&lt;/b&gt;&lt;script&gt;" in html and "<b>" not in html


def test_a_server_with_a_key_gets_it_from_the_page(browser, default_model_dir):
    from triforce.server.guard import allowed_hosts

    keyed = LiveServer(str(default_model_dir), max_context=512, batch_size=1, api_key="sesame",
                       hosts=allowed_hosts("127.0.0.1"))
    try:
        browser.open(keyed.url + "/")
        assert browser.wait("document.getElementById('info').textContent.includes('API key') && "
                            "getComputedStyle(document.getElementById('key')).display !== 'none'")
        browser.js("const k = document.getElementById('key'); k.value = 'sesame'; "
                   "k.dispatchEvent(new Event('change'))")
        browser.wait("document.getElementById('info').textContent.startsWith('method')")
        ask(browser, "Say hello.")
        answer = browser.wait(f"{ANSWERS}[0] && {ANSWERS}[0].dataset.state && {ANSWERS}[0].textContent")
        assert "done:" in answer
        assert httpx.get(keyed.url + "/", headers={"Host": "evil.example"}).status_code == 400  # the Host policy
    finally:
        keyed.stop()
