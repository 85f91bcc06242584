"""The commit protocol: samples are committed whole or absent, and a resumed writer continues exactly."""

from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from helpers import tiny_metadata

from streamx.data.tokenize import Reject
from streamx.pipeline.writer import PartWriter
from streamx.store import (
    FP8_STORAGE,
    Commit,
    Output,
    OwnedPart,
    Store,
    StoreError,
    StoreMetadata,
    bf16_to_bits,
    create_part,
    make_layout,
    open_for_run,
    prepare,
)
from streamx.store.fp8 import quantize_fp8

K, H = 3, 8
LAYOUT = make_layout(K, H, chunk_tokens=4, shard_tokens=8)
ZSTD_LAYOUT = make_layout(K, H, chunk_tokens=4, shard_tokens=8, compressor="zstd")
FP8_LAYOUT = make_layout(K, H, chunk_tokens=4, shard_tokens=8, storage="fp8")
BLOSC_LAYOUT = make_layout(K, H, chunk_tokens=4, shard_tokens=8, compressor="bitshuffle-lz4", storage="fp8")
LAYOUTS = pytest.mark.parametrize("layout", [LAYOUT, ZSTD_LAYOUT, FP8_LAYOUT, BLOSC_LAYOUT],
                                  ids=["streamed", "zstd-through-zarr", "fp8-streamed", "fp8-blosc-through-zarr"])


def meta(storage="bf16", **compat) -> StoreMetadata:
    return tiny_metadata(storage, H, **compat)


def open_writer(path, layout=LAYOUT, metadata=None, overwrite=False) -> PartWriter:
    metadata = metadata or meta(layout.storage.name)
    prepare(str(path), metadata, overwrite)
    return PartWriter(OwnedPart(str(path), "part-00000").open(open_for_run(str(path), metadata), layout))


def random_sample(row_id: int, length: int, g: torch.Generator):
    ids = torch.randint(0, 50_000, (length,), generator=g)
    mask = (torch.rand(length, generator=g) > 0.5).to(torch.uint8)
    hidden = torch.randn(length, K, H, generator=g).to(torch.bfloat16)
    return row_id, ids.numpy(), mask.numpy(), hidden


def append(writer, sample):
    row_id, ids, mask, hidden = sample
    if "hidden_states_scales" in writer.arrays:  # an fp8 part: what the GPU stage hands over for --storage fp8
        values, scales = quantize_fp8(hidden)
        writer.append(row_id, ids, mask, FP8_STORAGE.to_bits(values), scales.numpy())
    else:
        writer.append(row_id, ids, mask, bf16_to_bits(hidden))


def assert_stored(path, samples):
    store = Store(path)
    assert sorted(store.row_ids().tolist()) == sorted(s[0] for s in samples)
    for row_id, ids, mask, hidden in samples:
        got = store.sample(row_id)
        assert torch.equal(got.input_ids, torch.from_numpy(ids))
        assert torch.equal(got.loss_mask, torch.from_numpy(mask).long())
        assert got.hidden_states.dtype == torch.bfloat16
        if store.metadata.storage == "bf16":
            assert torch.equal(got.hidden_states.view(torch.int16), hidden.view(torch.int16))  # bit-exact
        else:
            raw, (values, scales) = store.sample(row_id, raw=True), quantize_fp8(hidden)
            assert raw.hidden_states.dtype == torch.float8_e4m3fn and raw.hidden_states_scales.dtype == torch.float32
            assert torch.equal(raw.hidden_states.view(torch.uint8), values.view(torch.uint8))  # bit-exact
            assert torch.equal(raw.hidden_states_scales, scales)
            assert torch.equal(got.hidden_states, values.bfloat16() * scales.bfloat16()[:, None, None])


@pytest.fixture
def samples():
    g = torch.Generator().manual_seed(0)
    lengths = [3, 5, 1, 12, 7, 8, 2, 20, 4, 9]  # straddle shards, longer than a shard, exactly a shard
    return [random_sample(100 + i, n, g) for i, n in enumerate(lengths)]


@LAYOUTS
def test_roundtrip_bit_exact(tmp_path, samples, layout):
    writer = open_writer(tmp_path / "s.zarr", layout)
    for s in samples:
        append(writer, s)
    writer.close()
    assert_stored(str(tmp_path / "s.zarr"), samples)
    arr = zarr.open_group(str(tmp_path / "s.zarr"))["parts/part-00000/hidden_states"]
    assert arr.shape == (sum(len(s[1]) for s in samples), K, H)  # real tokens only, no padding


@LAYOUTS
def test_uncommitted_tail_is_absent_then_resumed(tmp_path, samples, layout):
    path = str(tmp_path / "s.zarr")
    writer = open_writer(path, layout)
    writer.reject(Reject(7, "too_long", "x"))  # committed with the next shard
    for s in samples[:6]:  # 3+5+1+12+7+8 = 36 tokens: shards 0..3 written (32 tokens)
        append(writer, s)
    writer.reject(Reject(8, "too_long", "y"))  # after the last shard: not committed
    writer.wait_committed()  # the committer has caught up with the appends (as it does at most one shard behind)
    # "crash": no close. Samples ending at or before token 32 are committed, the one ending at 36 is not.
    assert sorted(Store(path).row_ids().tolist()) == [100, 101, 102, 103, 104]
    done = Store(path).done_row_ids()
    assert set(done) == {100, 101, 102, 103, 104, 7} and len(done) == 6
    assert 7 in done and 8 not in done and 105 not in done and -1 not in done and 10**6 not in done

    writer = open_writer(path, layout)
    for s in samples[5:]:  # the uncommitted sample again, then the rest
        append(writer, s)
    writer.close()
    assert_stored(path, samples)
    assert Store(path).rejected() == [(7, "too_long")]
    assert not list(tmp_path.rglob(".*.tmp-*"))  # the crashed run's half-written shard was removed


@pytest.mark.parametrize("layout", [LAYOUT, FP8_LAYOUT], ids=["bf16", "fp8"])
def test_streamed_shards_are_the_bytes_zarr_writes(tmp_path, samples, layout):
    """The shard files the writer streams are byte for byte what zarr-python itself writes for the
    same values (full shards and the partial last one), so any Zarr v3 reader reads them. zarr leaves out
    chunks that hold only the fill value unless told to keep them, and the writer keeps them: the first shard
    of loss_mask is all zero (a prompt), and zarr is told to keep empty chunks."""
    path = tmp_path / "s.zarr"
    writer = open_writer(path, layout)
    samples = [(r, ids, np.zeros_like(mask) if i < 2 else mask, h) for i, (r, ids, mask, h) in enumerate(samples)]
    assert sum(len(s[1]) for s in samples[:2]) == LAYOUT.shard_tokens  # tokens 0..7: a whole shard of zeros
    for s in samples:
        append(writer, s)
    writer.close()
    ours = zarr.open_group(str(path), mode="r")["parts/part-00000"]
    with zarr.config.set({"array.write_empty_chunks": True}):
        reference = create_part(zarr.open_group(str(tmp_path / "ref.zarr"), mode="w"), "part-00000", layout)
    hidden = torch.cat([s[3] for s in samples])
    values = {"input_ids": np.concatenate([s[1] for s in samples]),
              "loss_mask": np.concatenate([s[2] for s in samples])}
    if layout.storage.scaled:
        fp8, scales = quantize_fp8(hidden)
        values.update(hidden_states=FP8_STORAGE.to_bits(fp8), hidden_states_scales=scales.numpy())
    else:
        values["hidden_states"] = bf16_to_bits(hidden)
    n = len(values["input_ids"])
    assert n % LAYOUT.shard_tokens and n % LAYOUT.chunk_tokens  # the last shard and its last chunk are partial
    for name, v in values.items():
        reference[name].resize(v.shape)
        with zarr.config.set({"array.write_empty_chunks": True}):
            reference[name][:] = v  # zarr-python's own encoding
        assert np.array_equal(ours[name][:], v)
        shards = sorted((path / "parts/part-00000" / name / "c").rglob("*"))
        shards = [f for f in shards if f.is_file()]
        assert len(shards) == -(-n // LAYOUT.shard_tokens)
        for f in shards:
            twin = tmp_path / "ref.zarr" / f.relative_to(path)
            assert f.read_bytes() == twin.read_bytes(), f"{f.relative_to(path)} differs from zarr's encoding"


def test_resumes_a_store_with_compressed_token_ids(tmp_path, samples):
    """Stores written before the ids and masks were streamed keep them zstd-compressed: a resumed
    writer appends to them through zarr."""
    path = str(tmp_path / "s.zarr")
    prepare(path, meta())
    part = zarr.open_group(path).require_group("parts").create_group("part-00000",
                                                                   attributes={"commit": Commit().to_json()})
    c, s = LAYOUT.chunk_tokens, LAYOUT.shard_tokens
    part.create_array("hidden_states", shape=(0, K, H), dtype="uint16", chunks=(c, K, H), shards=(s, K, H),
                      fill_value=0)
    for name, dtype in (("input_ids", "int64"), ("loss_mask", "uint8")):
        part.create_array(name, shape=(0,), dtype=dtype, chunks=(c,), shards=(s,),
                          compressors=[zarr.codecs.ZstdCodec(level=1)], fill_value=0)
    for name in ("sample_row_id", "sample_offset", "sample_length", "reject_row_id", "reject_reason"):
        part.create_array(name, shape=(0,), dtype="uint8" if name == "reject_reason" else "int64", chunks=(1024,),
                          fill_value=0)
    for chunk in (samples[:3], samples[3:]):
        writer = open_writer(path)
        assert type(writer.sinks["input_ids"]).__name__ == "BufferedShards"
        for sample in chunk:
            append(writer, sample)
        writer.close()
    assert_stored(path, samples)


def test_resume_after_clean_close_appends_into_partial_shard(tmp_path, samples):
    path = str(tmp_path / "s.zarr")
    for chunk in (samples[:3], samples[3:7], samples[7:]):  # 9 tokens: the first close leaves a partial shard
        writer = open_writer(path)
        for s in chunk:
            append(writer, s)
        writer.close()
    assert_stored(path, samples)


def test_garbage_beyond_commit_is_overwritten(tmp_path, samples):
    path = str(tmp_path / "s.zarr")
    writer = open_writer(path)
    for s in samples[:4]:
        append(writer, s)
    writer.close()
    # a crashed run wrote tokens and index entries past the commit without committing them
    part = zarr.open_group(path)["parts/part-00000"]
    n = part["hidden_states"].shape[0]
    part["hidden_states"].resize((n + 16, K, H))
    part["hidden_states"][n:] = np.full((16, K, H), 0x7FC0, dtype=np.uint16)  # NaN bit patterns
    part["sample_row_id"].resize((6,))
    part["sample_row_id"][4:] = [999, 998]
    assert_stored(path, samples[:4])  # readers see the commit only
    writer = open_writer(path)
    for s in samples[4:]:
        append(writer, s)
    writer.close()
    assert_stored(path, samples)
    assert part["hidden_states"].shape[0] == sum(len(s[1]) for s in samples)


def test_incompatible_store_is_refused(tmp_path):
    path = str(tmp_path / "s.zarr")
    prepare(path, meta())
    with pytest.raises(StoreError, match="incompatible run.*model: store has 'm', this run 'other'.*--overwrite"):
        prepare(path, meta(model="other"))
    with pytest.raises(StoreError, match="incompatible run.*data: store has 'd', this run 'e'"):
        open_for_run(path, meta(data="e"))
    with pytest.raises(StoreError, match="model: store has 'm', this run 'other'; packing.*start over, or"):
        prepare(path, meta(model="other", packing="on"))  # two differences: no hint to resume
    # packing alone (a store from before the model could pack): the error says how to resume it
    with pytest.raises(StoreError, match="packing: store has 'off', this run 'on'.*--packing off to resume it"):
        prepare(path, meta(packing="on"))
    prepare(path, meta(model="other"), overwrite=True)
    assert Store(path).metadata.compat.model == "other"


def test_the_data_is_its_bytes_not_its_path(tmp_path):
    """A store records its data's fingerprint: the same bytes moved elsewhere resume it, other bytes under the
    same path do not; a store from before fingerprints is compared by path, as it was."""
    from streamx.data.provenance import fingerprint

    data = tmp_path / "chats.jsonl"
    data.write_text('{"text": "one"}\n')
    path = str(tmp_path / "s.zarr")
    prepare(path, meta(data=str(data), data_fingerprint=fingerprint(str(data))))
    moved = tmp_path / "elsewhere.jsonl"
    data.rename(moved)
    open_for_run(path, meta(data=str(moved), data_fingerprint=fingerprint(str(moved))))  # accepted
    moved.write_text('{"text": "one"}\n{"text": "two"}\n')
    with pytest.raises(StoreError, match=r"data_fingerprint: store has 'file:16:.*', this run 'file:32:"):
        open_for_run(path, meta(data=str(moved), data_fingerprint=fingerprint(str(moved))))
    old = str(tmp_path / "old.zarr")
    prepare(old, meta(data="a.jsonl"))  # no fingerprint recorded
    open_for_run(old, meta(data="a.jsonl", data_fingerprint="file:1:x"))
    with pytest.raises(StoreError, match="data: store has 'a.jsonl', this run 'b.jsonl'"):
        open_for_run(old, meta(data="b.jsonl", data_fingerprint="file:1:x"))


def test_refuses_to_overwrite_a_non_store(tmp_path):
    (tmp_path / "precious.txt").write_text("data")
    with pytest.raises(StoreError, match="is not a streamx store"):
        prepare(str(tmp_path), meta())
    assert (tmp_path / "precious.txt").exists()


def test_a_store_root_without_its_parts_group_reads_as_empty_and_resumes(tmp_path, samples):
    """A root marked made but without its `parts` group (left by streamx before 0.7 killed between prepare's two
    writes, or seen by a job-array rank while another creates the store) has no parts: it opens, inspects,
    resumes and is overwritten."""
    import shutil

    from helpers import cli

    path = str(tmp_path / "s.zarr")
    for overwrite in (False, True):
        prepare(path, meta())
        shutil.rmtree(Path(path) / "parts")
        output = Output.read(path)  # the first step of a run, --overwrite too
        assert output.is_store and output.commits == () and output.state() == "resuming: 0 samples already " \
            "committed in 0 part(s)"
        store = Store(path)
        assert len(store) == 0 and store.parts == {} and store.incomplete_parts == []
        inspected = cli("inspect", path)
        assert inspected.returncode == 0, inspected.stderr
        writer = open_writer(path, overwrite=overwrite)  # the resume (prepare, open_for_run, the part opened)
        for s in samples[:3]:
            append(writer, s)
        writer.close()
        assert_stored(path, samples[:3])


@pytest.mark.parametrize("failing", ["zarr.json", "parts/zarr.json"])
def test_a_store_is_marked_made_only_once_its_parts_group_is_there(tmp_path, monkeypatch, failing):
    """prepare writes the `parts` group, then the root's zarr.json with the `streamx` attribute that marks the
    store made: whichever write fails (a full disk here; a kill alike), no store is marked made without its
    parts, what is left is no stray file to the output check, and the next run makes the store."""
    import errno

    from streamx.base.durable import DurableLocalStore

    path = tmp_path / "s.zarr"
    real = DurableLocalStore._set

    async def full_disk(self, key, value, exclusive=False):
        if Path(self.root) / key == path / failing:
            raise OSError(errno.ENOSPC, "No space left on device")
        return await real(self, key, value, exclusive)

    monkeypatch.setattr(DurableLocalStore, "_set", full_disk)
    with pytest.raises(StoreError, match="No space left on device"):
        prepare(str(path), meta())
    monkeypatch.setattr(DurableLocalStore, "_set", real)
    assert not Output.read(str(path)).is_store
    Output.read(str(path)).check()
    prepare(str(path), meta())
    assert (path / "parts" / "zarr.json").exists() and Output.read(str(path)).is_store


def test_rows_by_source_row_and_by_position(tmp_path, samples):
    writer = open_writer(tmp_path / "s.zarr")
    for s in reversed(samples):  # committed in descending row order
        append(writer, s)
    writer.close()
    store = Store(str(tmp_path / "s.zarr"))
    assert store.row_ids().tolist() == sorted(s[0] for s in samples)
    assert [store.sample(row).row_id for row in store.row_ids().tolist()] == store.row_ids().tolist()
    # positions are the index's (store order: as written, here descending rows)
    assert [store.at(i).row_id for i in range(len(store))] == store.index.rows.tolist() == sorted(
        store.row_ids().tolist(), reverse=True)
    with pytest.raises(IndexError, match="out of range"):
        store.at(len(store))
    with pytest.raises(KeyError, match="source row 99 is not in the store"):
        store.sample(99)


def test_output_state_says_what_a_run_will_do(tmp_path, samples):
    path = str(tmp_path / "s.zarr")
    assert Output.read(path).state() == "new store"
    writer = open_writer(path)
    for s in samples[:3]:
        append(writer, s)
    writer.close()
    assert Output.read(path).state() == "resuming: 3 samples already committed in 1 part(s)"
    assert Output.read(path).state(overwrite=True) == "existing store, replaced (--overwrite)"


def test_metadata_round_trips_and_reads_records_with_unknown_fields():
    m = meta()
    record = m.to_json()
    assert record["num_slots"] == 3 and record["bytes_per_token"] == 3 * H * 2  # for readers of the raw JSON
    assert StoreMetadata.from_json({**record, "added_by_a_later_version": 1}) == m


def test_storage_is_part_of_what_a_resume_must_match(tmp_path):
    path = str(tmp_path / "s.zarr")
    prepare(path, meta("bf16"))
    with pytest.raises(StoreError, match="incompatible run.*storage: store has 'bf16', this run 'fp8'"):
        prepare(path, meta("fp8"))
    # a record from before fp8 storage existed (format /1) has no storage field: it is a bf16 store
    root = zarr.open_group(path)
    old = dict(root.attrs["streamx"])
    del old["compat"]["storage"], old["storage"]
    root.attrs["streamx"] = {**old, "format": "streamx-store/1"}
    prepare(path, meta("bf16"))
    with pytest.raises(StoreError, match="storage: store has 'bf16', this run 'fp8'"):
        open_for_run(path, meta("fp8"))


def test_packed_and_padded_runs_do_not_mix_in_one_store(tmp_path):
    """They round differently, and a resumed store must equal an uninterrupted run bit for bit."""
    path = str(tmp_path / "s.zarr")
    prepare(path, meta(packing="on"))
    with pytest.raises(StoreError, match="packing: store has 'on', this run 'off'"):
        prepare(path, meta(packing="off"))
    root = zarr.open_group(path)  # a store from before packing existed was padded
    old = dict(root.attrs["streamx"])
    del old["compat"]["packing"]
    root.attrs["streamx"] = old
    prepare(path, meta(packing="off"))
    with pytest.raises(StoreError, match="packing: store has 'off', this run 'on'"):
        open_for_run(path, meta(packing="on"))


def test_a_newer_store_format_is_refused_in_one_line(tmp_path):
    path = str(tmp_path / "s.zarr")
    prepare(path, meta())
    root = zarr.open_group(path)
    root.attrs["streamx"] = {**root.attrs["streamx"], "format": "streamx-store/9"}
    with pytest.raises(StoreError, match=r"format 'streamx-store/9', which this streamx .* cannot read.*upgrade"):
        Store(path)


@pytest.mark.parametrize("layout", [LAYOUT, FP8_LAYOUT], ids=["bf16", "fp8"])
def test_shard_files_read_what_zarr_reads(tmp_path, samples, layout):
    """The reader's direct path (a view of the mapped shard files at the offsets the shard index gives) returns
    what zarr-python's own read returns, for every sample, ranges across shards, and the partial last shard;
    a shard whose index does not match its checksum is refused."""
    from streamx.store.shards import ShardFiles, ShardMaps, shard_key

    path = tmp_path / "s.zarr"
    writer = open_writer(path, layout)
    for s in samples:
        append(writer, s)
    writer.close()
    store = Store(str(path))
    part = store.parts["part-00000"]
    n = store.num_tokens
    for name in layout.storage.token_arrays:
        shard_bytes = (tmp_path / "s.zarr/parts/part-00000" / name / shard_key(part[name], 0)).stat().st_size
        few_maps = ShardMaps(max_bytes=2 * shard_bytes)
        arr, files, few = part[name], ShardFiles(part[name]), ShardFiles(part[name], few_maps)
        for a, b in [(0, n), (7, 9), (5, 21), (n - 3, n), *((int(o), int(o + k)) for o, k in
                                                               zip(store.index.offsets, store.index.lengths,
                                                                   strict=True))]:
            assert np.array_equal(files.read(a, b), arr[a:b]), (name, a, b)
            assert np.array_equal(few.read(b - 1, b), arr[b - 1 : b]) and len(few_maps.items) <= 2  # dropped
    got = store.sample(samples[3][0])  # the read API goes the direct way on this local, uncompressed store
    assert torch.equal(got.input_ids, torch.from_numpy(samples[3][1]))
    shard = path / "parts/part-00000/hidden_states" / shard_key(part["hidden_states"], 0)
    data = bytearray(shard.read_bytes())
    data[-6] ^= 0xFF  # inside the index
    shard.write_bytes(bytes(data))
    with pytest.raises(OSError, match="the shard index does not match its checksum"):
        ShardFiles(part["hidden_states"]).read(0, 4)


def test_shard_files_read_from_many_threads(tmp_path, samples):
    """convert's threads share one store's maps: every read right, the mapped bytes counted right."""
    from concurrent.futures import ThreadPoolExecutor

    from streamx.store.shards import ShardFiles, ShardMaps

    path = tmp_path / "s.zarr"
    writer = open_writer(path, LAYOUT)
    for s in samples * 8:
        append(writer, s)
    writer.close()
    arr = Store(str(path)).parts["part-00000"]["hidden_states"]
    maps = ShardMaps(max_bytes=3 * 2 ** 12)  # a few maps: constant eviction
    files, n = ShardFiles(arr, maps), arr.shape[0]
    ranges = [(a, min(n, a + 5)) for a in np.random.default_rng(0).integers(0, n - 1, 400).tolist()]
    expected = [arr[a:b] for a, b in ranges]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda r: files.read(*r).copy(), ranges))
    assert all(np.array_equal(g, e) for g, e in zip(got, expected, strict=True))
    assert maps.held == sum(len(m) for m, _ in maps.items.values())


def test_a_file_url_is_a_local_store(tmp_path, samples):
    """file://PATH is the local folder PATH (streamx.base.location), not an object store: zarr writes it
    durably, its part is locked, and its samples are read straight from the shard files."""
    from streamx.base.durable import DurableLocalStore
    from streamx.base.location import local_path
    from streamx.base.locks import LockedError
    from streamx.store.shards import streamable_dir

    assert local_path("s3://bucket/s.zarr") is None and local_path("rel/s.zarr") == Path("rel/s.zarr")
    url = f"file://{tmp_path / 's.zarr'}"
    assert local_path(url) == tmp_path / "s.zarr"
    root = prepare(url, meta())
    assert isinstance(root.store, DurableLocalStore) and (tmp_path / "s.zarr" / "zarr.json").exists()
    with OwnedPart(url, "part-00000") as owned:
        with pytest.raises(LockedError):
            OwnedPart(str(tmp_path / "s.zarr"), "part-00000")  # the same part by its plain path: held
        writer = PartWriter(owned.open(open_for_run(url, meta()), LAYOUT))
        for s in samples:
            append(writer, s)
        writer.close()
    store = Store(url)
    streamed = streamable_dir(store.parts["part-00000"]["hidden_states"])
    assert streamed == tmp_path / "s.zarr/parts/part-00000/hidden_states"
    assert_stored(url, samples)


@pytest.mark.parametrize("mask, what", [([0] * 8 + [1] * 4, "a whole shard"), ([1] * 4 + [0] * 4 + [1] * 4, "a chunk")])
def test_shards_zarr_wrote_read_with_what_they_leave_out(tmp_path, mask, what):
    """Shards that zarr wrote itself (an object-store run copied to a local disk) leave out the chunks, and whole
    shards, that hold only the fill value (zarr's write_empty_chunks=False): the shard reader reads them as the
    fill value, through the read API, convert and verify alike."""
    from unittest import mock

    from streamx.store.shards import ShardFiles, shard_key

    path = tmp_path / "s.zarr"
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(12, K, H, generator=g).to(torch.bfloat16)
    with mock.patch("streamx.store.shards.streamable_dir", lambda arr: None):  # as on s3: zarr writes the shards
        writer = open_writer(path)
        assert type(writer.sinks["loss_mask"]).__name__ == "BufferedShards"
        writer.append(7, np.arange(1, 13), np.array(mask, np.uint8), bf16_to_bits(hidden))
        writer.close()
    arr = zarr.open_group(str(path), mode="r")["parts/part-00000/loss_mask"]
    first = path / "parts/part-00000/loss_mask" / shard_key(arr, 0)
    assert first.exists() == (what == "a chunk")  # zarr left the all-zero shard out
    store = Store(str(path))
    assert store.sample(7).loss_mask.tolist() == mask
    assert torch.equal(store.sample(7).hidden_states.view(torch.int16), hidden.view(torch.int16))
    assert np.array_equal(ShardFiles(arr).read(2, 10), arr[2:10])


def test_one_map_budget_for_the_whole_process(tmp_path, samples):
    """The shard maps of every array, part and store a process reads share one budget (one per DataLoader worker
    process, not one per array per part): a reader of each of a store's token arrays, and a second store, stay
    within it together."""
    from streamx.store.shards import PROCESS_MAPS, ShardFiles, ShardMaps

    maps, readers = ShardMaps(max_maps=3), []
    for name in ("a.zarr", "b.zarr"):
        writer = open_writer(tmp_path / name, LAYOUT)
        for s in samples:
            append(writer, s)
        writer.close()
        part = Store(str(tmp_path / name)).parts["part-00000"]
        readers += [ShardFiles(part[array], maps) for array in LAYOUT.storage.token_arrays]
    n = readers[0].arr.shape[0]
    for reader in readers:
        for a in range(0, n, LAYOUT.shard_tokens):
            assert np.array_equal(reader.read(a, a + 1), reader.arr[a : a + 1])
            assert len(maps.items) <= 3
    assert ShardFiles(readers[0].arr).maps is PROCESS_MAPS  # the default: the process's one budget


def test_a_part_half_created_by_a_killed_writer_is_passed_over_then_made_anew(tmp_path, samples, monkeypatch):
    """A writer killed while creating its part (the group there, its arrays not all) leaves no commit record:
    readers pass the part over, a resume opens the store and creates the part anew, and inspect says so."""
    path = str(tmp_path / "s.zarr")
    writer = open_writer(path)
    for s in samples[:4]:
        append(writer, s)
    writer.close()
    real = zarr.Group.create_array

    def killed_after_two(self, name, **kw):  # the kill lands between two arrays
        if name == "input_ids":
            raise KeyboardInterrupt("killed")
        return real(self, name, **kw)

    monkeypatch.setattr(zarr.Group, "create_array", killed_after_two)
    with pytest.raises(KeyboardInterrupt):
        OwnedPart(path, "part-00001").open(open_for_run(path, meta()), LAYOUT)
    monkeypatch.setattr(zarr.Group, "create_array", real)
    assert "part-00001" in zarr.open_group(path, mode="r")["parts"]  # half there
    store = Store(path)
    assert list(store.parts) == ["part-00000"] and store.incomplete_parts == ["part-00001"]
    assert_stored(path, samples[:4])
    assert store.summary()["incomplete_parts"] == ["part-00001"]
    target = open_for_run(path, meta())  # the resume
    assert sorted(target.done_rows) == [s[0] for s in samples[:4]]
    writer = PartWriter(OwnedPart(path, "part-00001").open(target, LAYOUT))
    for s in samples[4:]:
        append(writer, s)
    writer.close()
    assert Store(path).incomplete_parts == []
    assert_stored(path, samples)
    # streamx before 0.4 wrote the record first: a part with a record and no arrays is passed over alike
    zarr.open_group(path, mode="r+")["parts"].create_group("part-00002", attributes={"commit": Commit().to_json()})
    store = Store(path)
    assert list(store.parts) == ["part-00000", "part-00001"] and store.incomplete_parts == ["part-00002"]
    assert any("part-00002: being created, or left half-created" in line for line in store.describe())
    OwnedPart(path, "part-00002").open(open_for_run(path, meta()), LAYOUT)  # a resume makes it anew
    assert Store(path).incomplete_parts == []


def test_a_second_writer_of_the_same_part_is_fenced_off(tmp_path, samples):
    """Where the lock does not hold (Lustre localflock, NFS without locks, object stores), two writers can open
    one part: each commit names its writer and each writer reads the record afresh before it puts a shard in
    place and commits, so the one that finds the other's commit stops in one line, and what was committed
    stays readable."""
    path = str(tmp_path / "s.zarr")
    open_writer(path).close()  # the part exists
    first = PartWriter(OwnedPart(path, "part-00000").open(open_for_run(path, meta()), LAYOUT))
    second = PartWriter(open_for_run(path, meta()).root["parts/part-00000"])  # no lock: the lock did not hold
    for s in samples[:4]:  # 21 tokens: shards 0 and 1 committed
        append(first, s)
    first.wait_committed()
    with pytest.raises(StoreError, match=r"was committed by another writer since this one opened it \(pid \d+ on "
                                         r".*\): two processes are writing the same part"):
        for s in samples[:4]:
            append(second, s)
        second.close()
    for s in samples[4:]:
        append(first, s)
    first.close()  # the first goes on: the record is its own
    assert Store(path).commits["part-00000"].writer["id"] == first.writer["id"]
    assert_stored(path, samples)


def test_a_store_at_a_mount_root_is_locked_from_inside(tmp_path, samples, monkeypatch):
    """A store whose parent folder is not ours to write (a filesystem's mount root) keeps its lock inside, at the
    top: a second writer is refused, zarr lists no stray member, the output check and --overwrite pass it over."""
    import os
    import warnings

    import streamx.base.locks as locks

    store = tmp_path / "mnt" / "fast"
    store.mkdir(parents=True)
    real_access = os.access
    monkeypatch.setattr(locks.os, "access", lambda p, mode: False if Path(p) == store.parent else real_access(p, mode))
    assert locks.lock_file(store, "part-00000") == store / ".streamx-lock-part-00000"
    with OwnedPart(str(store), "part-00000") as owned:
        assert (store / ".streamx-lock-part-00000").exists()
        with pytest.raises(locks.LockedError):
            OwnedPart(str(store), "part-00000")
        Output.read(str(store)).check()  # the lock alone is no stray file
        prepare(str(store), meta())
        writer = PartWriter(owned.open(open_for_run(str(store), meta()), LAYOUT))
        for s in samples:
            append(writer, s)
        writer.close()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # zarr's "not recognized as a component of a Zarr hierarchy"
            assert_stored(str(store), samples)
        prepare(str(store), meta(), overwrite=True)  # --overwrite empties the store, its lock stays held
        assert (store / ".streamx-lock-part-00000").exists() and len(Store(str(store))) == 0
        with pytest.raises(locks.LockedError):
            OwnedPart(str(store), "part-00000")


def test_a_command_leaves_no_lock_file_behind(tiny_chat_model_dir, chat_jsonl, tmp_path, monkeypatch):
    """A run that fails once its store exists, the run that resumes it and a convert of the store: each releases
    its lock and removes the lock file (beside the store or folder), so that nothing of ours is left over."""
    from helpers import cli, fail_at_batch, run_args

    store, spec = tmp_path / "s.zarr", tmp_path / "spec"
    args = run_args(tiny_chat_model_dir, chat_jsonl, store, max_samples=40)
    fail_at_batch(monkeypatch, 2)
    failed = cli(*args)
    monkeypatch.undo()
    assert failed.returncode == 1 and "injected" in failed.stderr and store.exists(), failed.stderr
    resumed = cli(*args)
    converted = cli("convert", str(store), "--out", str(spec), "--no-progress")
    assert [resumed.returncode, converted.returncode] == [0, 0], resumed.stderr + converted.stderr
    assert [p.name for p in tmp_path.rglob("*streamx-lock*")] == []


def test_takers_racing_for_a_lock_file_that_each_release_removes_never_hold_it_together(tmp_path):
    """Threads take and release one lock over and over (flock locks an open file, so each open is a taker of its
    own, as another process's would be), each release removing the file while held: a taker that opened the
    removed file must not count it as held beside the one that locked the new file. Never two holders."""
    import sys
    import threading
    import time

    from streamx.base.locks import Lock, LockedError

    path, guard = tmp_path / ".x.streamx-lock", threading.Lock()
    holders, most, taken = set(), [0], [0]

    def take_and_release() -> None:
        mine = 0
        while mine < 50:
            try:
                lock = Lock(path, "x")
            except LockedError:
                continue
            mine += 1
            with guard:
                holders.add(id(lock))
                most[0], taken[0] = max(most[0], len(holders)), taken[0] + 1
            time.sleep(0.0002)  # held a while: a second holder, were there one, would overlap it
            with guard:
                holders.discard(id(lock))
            lock.release()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads between any two steps of taking and releasing
    try:
        threads = [threading.Thread(target=take_and_release) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert most[0] == 1 and taken[0] == 200 and not path.exists()


def test_two_processes_making_the_store_at_once_both_open_it(tmp_path, monkeypatch):
    """Independent ranks started at once (a job array) each find no store and make it: the one that finds the
    `parts` group made by the other meanwhile (zarr's ContainsGroupError) goes on and makes or opens the root
    (before, it stopped saying the store was not a streamx store: 1 start in ~20 of two real processes)."""
    import importlib

    prepare_module = importlib.import_module("streamx.store.prepare")
    path, real_open_group, raced = tmp_path / "s.zarr", zarr.open_group, []

    def the_other_process_first(store, mode):
        if not raced and str(getattr(store, "root", store)).endswith("parts"):
            raced.append(True)
            real_open_group(store, mode=mode)  # the other process's parts, made between our check and our write
            raise zarr.errors.ContainsGroupError("A group exists in store at path ''.")
        return real_open_group(store, mode=mode)

    monkeypatch.setattr(prepare_module.zarr, "open_group", the_other_process_first)
    root = prepare(str(path), meta())
    assert raced and "streamx" in root.attrs and "parts" in root
    monkeypatch.undo()
    assert len(Store(str(path))) == 0
