"""A step's device state: block tables kept on the device and updated from what changed, staged uploads into
reused aligned buffers, and the kernels' metadata built with the batch, equal to what attention used to
build for itself."""

import torch

from deployments.model_rank.device_batch import DeviceBatches, Sink
from deployments.model_rank.device_tables import SINK_ROW, DeviceBlockTables
from deployments.model_rank.step_rows import StepRows
from deployments.model_rank.step_upload import DEPTH, StagedUpload
from kernels.paged_meta import ALIGN, ALL_ROWS, DECODE_MAX_QUERY, build_paged_meta

CPU = torch.device("cpu")


def _step(tables: DeviceBlockTables, block_tables: list[list[int]]) -> tuple[list[int], list[int], torch.Tensor]:
    """Place and apply a step: (rows, changed entries' values, the gathered tables)."""
    delta = tables.place(block_tables)
    index = torch.tensor(delta.index, dtype=torch.int64)
    tables.apply(delta, index, torch.tensor(delta.values, dtype=torch.int32))
    return delta.rows, delta.values, tables.gather(torch.tensor(delta.rows, dtype=torch.int32))


def _holds(gathered: torch.Tensor, block_tables: list[list[int]]) -> bool:
    return all(gathered[i, : len(t)].tolist() == t for i, t in enumerate(block_tables))


def test_block_tables_upload_only_the_entries_that_changed() -> None:
    tables = DeviceBlockTables(CPU, width=20, sink_block=99, rows=2)
    assert tables.width == 32 and tables.table[SINK_ROW, 0] == 99  # whole 16-entry widths; the sink's row
    rows, sent, gathered = _step(tables, [[1, 2], [5]])
    assert SINK_ROW not in rows and sent == [1, 2, 5] and _holds(gathered, [[1, 2], [5]])
    rows2, sent, gathered = _step(tables, [[1, 2], [5, 6]])  # the second grew a block
    assert rows2 == rows and sent == [6] and _holds(gathered, [[1, 2], [5, 6]])
    rows3, sent, gathered = _step(tables, [[5, 6, 7]])  # the first ended: the second keeps its row
    assert rows3 == [rows[1]] and sent == [7]
    rows4, sent, gathered = _step(tables, [[8], [5, 6, 7]])  # a new sequence takes another row
    assert rows4[1] == rows[1] != rows4[0] and sent == [8] and _holds(gathered, [[8], [5, 6, 7]])
    _, sent, _ = _step(tables, [[8], [5, 6]])  # dropped draft blocks: nothing to send
    assert sent == []
    _, sent, gathered = _step(tables, [[8], [5, 6, 7], [1, 2, 3]])  # rows still hold 7, and 1, 2
    assert sent == [3] and _holds(gathered, [[8], [5, 6, 7], [1, 2, 3]])
    _, sent, gathered = _step(tables, [[8], [5, 6, 7], [1, 2, 3], [4]])  # more sequences than rows
    assert sent == [4] and tables.table.shape[0] == 8 and _holds(gathered, [[8], [5, 6, 7], [1, 2, 3], [4]])
    long = list(range(40))
    _, _, gathered = _step(tables, [[8], long])  # a longer table than the width widens every row
    assert tables.width == 48 and _holds(gathered, [[8], long])


def test_staged_uploads_reuse_aligned_buffers() -> None:
    upload = StagedUpload(CPU, torch.int32)
    first = upload.send([[1, 2, 3], [], [4]])
    assert [part.tolist() for part in first] == [[1, 2, 3], [], [4]]
    assert all(part.data_ptr() % (4 * ALIGN) == 0 for part in first)  # every part 64 bytes in
    later = [upload.send([[7] * 5])[0] for _ in range(DEPTH - 1)]
    assert [part.tolist() for part in first] == [[1, 2, 3], [], [4]]  # intact through DEPTH - 1 sends
    assert first[0].data_ptr() not in {part.data_ptr() for part in later}
    assert upload.send([[7] * 5])[0].data_ptr() == first[0].data_ptr()  # then its slot comes round again
    into = torch.zeros(64, dtype=torch.int32)
    assert upload.send([[9, 9]], into=into)[0].data_ptr() == into.data_ptr()


def test_the_batch_brings_the_attention_metadata_each_row_limit_needs() -> None:
    rows = StepRows(
        input_ids=list(range(23)),
        positions=[30, *range(17, 20), *range(0, 19)],
        slots=list(range(23)),
        logits_rows=[0, 3, 22],
        query_lens=[1, 3, 19],
        context_lens=[31, 20, 19],
        block_tables=[[4, 5], [6, 7], [8, 9]],
    )
    batches = DeviceBatches(CPU, 16, (DECODE_MAX_QUERY, ALL_ROWS), table_width=4, sink=Sink(block=10))
    batch = batches.build(rows)
    for limit in (DECODE_MAX_QUERY, ALL_ROWS):
        ours = batch.paged[limit]
        theirs = build_paged_meta(rows.query_lens, rows.context_lens, rows.block_tables, 16, CPU, limit)
        for name in ("context_lens", "query_starts", "query_lens", "row_token", "row_seq", "row_len", "prefill_seqs"):
            assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
        assert (ours.max_row_len, ours.max_prefill_query, ours.num_tokens) == (
            theirs.max_row_len,
            theirs.max_prefill_query,
            theirs.num_tokens,
        )
        assert torch.equal(ours.block_tables[:, :2], theirs.block_tables[:, :2])
    assert batch.paged[DECODE_MAX_QUERY].num_prefill == 1 and batch.paged[ALL_ROWS].num_rows == 23
    decode = batches.build(StepRows([1], [31], [0], [0], [1], [32], [[4, 5]]))
    assert decode.paged[DECODE_MAX_QUERY] is decode.paged[ALL_ROWS]  # one layout serves both limits
    assert decode.paged[ALL_ROWS].max_row_len == 2048  # whole groups of 8 splits of 256 keys
