"""`tensorfold tui`: a live terminal view of a server, and a small chat pane (docs/tui.md)."""

from textual import work
from textual.app import App, ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Footer, Header, Input, Static

from serve_app.tui.client import ServerClient
from serve_app.tui.readings import Readings

REPLICA_COLUMNS = ("replica", "running", "waiting", "KV", "decode tok/s", "prefill tok/s")
STATE_TITLES = {
    "loading": "Loading",
    "unauthorized": "Unauthorized",
    "unreachable": "Unreachable",
    "error": "Not serving",
}


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _number(value: float | int | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def overview_text(readings: Readings) -> str:
    """The figures panel: what runs, how fast, how long requests take, what the memory holds."""
    lines = [
        f"model      {readings.model}   window {_number(readings.context_length)}",
        f"requests   running {_number(readings.running)}   waiting {_number(readings.waiting)}"
        f"   finished {_number(readings.requests_total)}",
        f"rates      decode {_number(readings.decode_tokens_per_second, 1)} tok/s"
        f"   prefill {_number(readings.prefill_tokens_per_second, 1)} tok/s",
        f"TTFT       p50 {_seconds(readings.ttft_p50)}   p99 {_seconds(readings.ttft_p99)}",
        f"latency    p50 {_seconds(readings.latency_p50)}   p99 {_seconds(readings.latency_p99)}",
        f"KV cache   {'-' if readings.kv_usage is None else f'{readings.kv_usage:.0%}'} of the fullest pool",
        f"drafts     {'off' if readings.draft_acceptance is None else f'{readings.draft_acceptance:.0%} accepted'}",
        f"store      {_store_text(readings.store)}",
        f"routing    {', '.join(f'{k} {v}' for k, v in sorted(readings.routing.items())) or '-'}",
    ]
    if readings.policy:
        lines.append(f"policy     {readings.policy}")
    return "\n".join(lines)


def _store_text(store: dict | None) -> str:
    if not store:
        return "off"
    held = store.get("bytes_held")
    return f"{_number(held / 2**20 if held is not None else None, 1)} MiB held, {store.get('pieces_written', 0)} pieces written"


class MonitorApp(App):
    """Polls the server every `interval` seconds; the chat pane streams one reply at a time."""

    TITLE = "tensorfold"
    CSS = """
    #banner { height: auto; padding: 1 2; background: $error 30%; text-style: bold; display: none; }
    #figures { height: auto; }
    #overview { padding: 0 1; border: round $primary; height: auto; }
    #replicas { border: round $primary; height: auto; max-height: 12; }
    #reply { height: 1fr; border: round $secondary; padding: 0 1; }
    """
    BINDINGS = [("q", "quit", "Quit"), ("r", "poll", "Refresh")]

    def __init__(self, client: ServerClient, interval: float = 1.0) -> None:
        super().__init__()
        self.client = client
        self.interval = interval
        self.readings: Readings | None = None
        self.sub_title = client.address.url

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="banner")
        with Vertical(id="figures"):
            yield Static("waiting for the first reading", id="overview")
            yield DataTable(id="replicas", show_cursor=False)
        with Vertical():
            yield Input(placeholder="Ask the model, then Enter", id="prompt")
            yield Static("", id="reply")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#replicas", DataTable).add_columns(*REPLICA_COLUMNS)
        self.action_poll()
        self.set_interval(self.interval, self.action_poll)

    async def on_unmount(self) -> None:
        await self.client.close()

    @work(exclusive=True, group="poll")
    async def action_poll(self) -> None:
        readings = await self.client.poll()
        if self.is_running and self.screen.is_attached:  # a poll may return while the app exits
            self.show(readings)

    def show(self, readings: Readings) -> None:
        self.readings = readings
        banner = self.query_one("#banner", Static)
        banner.display = readings.state != "serving"
        if readings.state != "serving":
            banner.update(f"{STATE_TITLES.get(readings.state, readings.state)}: {readings.message}")
            return
        self.query_one("#overview", Static).update(overview_text(readings))
        table = self.query_one("#replicas", DataTable)
        table.clear()
        for r in readings.replicas:
            table.add_row(
                r.name,
                str(r.running),
                str(r.waiting),
                f"{r.kv_usage:.0%}",
                f"{r.decode_tokens_per_second:.1f}",
                f"{r.prefill_tokens_per_second:.1f}",
            )

    async def on_input_submitted(self, event: Input.Submitted) -> None:
        prompt = event.value.strip()
        if prompt:
            event.input.value = ""
            self.stream_reply(prompt)

    @work(exclusive=True, group="chat")
    async def stream_reply(self, prompt: str) -> None:
        pane = self.query_one("#reply", Static)
        model = self.readings.model if self.readings and self.readings.model else "default"
        text = f"> {prompt}\n"
        pane.update(text)
        async for piece in self.client.chat(model, prompt):
            text += piece
            pane.update(text)
        self.last_reply = text
