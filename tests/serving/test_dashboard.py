"""The dashboard in headless Chromium after some traffic: the DOM says the charts hold samples with KV pages in
them, and the screenshot has the experts' and the KV cache's colours painted in the pool chart."""

import asyncio
import shutil
import struct
import subprocess
import zlib

import httpx
import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1000,1000", "--virtual-time-budget=4000", "--hide-scrollbars"]  # fmt: skip
KV_BLUE, EXPERT_ORANGE = (0x1F, 0x77, 0xD4), (0xE8, 0x70, 0x2A)

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/run installs it)")


def traffic(url: str) -> None:
    """Concurrent long generations so the pool's KV share rises for a while."""
    async def run():
        body = {"prompt": "Once upon a time", "max_tokens": 100, "n": 4, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            responses = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(6)))
        assert all(r.status_code == 200 for r in responses)

    asyncio.run(run())


def chromium(tmp_path, *args: str) -> bytes:
    command = [CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *args]
    return subprocess.run(command, capture_output=True, timeout=90, check=True).stdout


def read_png(path) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB(A) bytes) of an 8-bit RGB or RGBA PNG, unfiltered."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, pos = {}, 8
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos : pos + 4]), data[pos + 4 : pos + 8]
        chunks[kind] = chunks.get(kind, b"") + data[pos + 8 : pos + 8 + length]
        pos += 12 + length
    width, height, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert depth == 8 and color in (2, 6)
    bpp = 3 if color == 2 else 4
    raw, stride, rows, prev = zlib.decompress(chunks[b"IDAT"]), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a, b = (line[i - bpp] if i >= bpp else 0), prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            line[i] = (line[i] + (0, a, b, (a + b) // 2, _paeth(a, b, c))[kind]) & 0xFF
        rows.append(bytes(line))
        prev = line
    return width, bpp, rows


def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    return a if pa <= pb and pa <= pc else b if pb <= pc else c


def count_colour(png, colour: tuple[int, int, int], tolerance: int = 12) -> int:
    width, bpp, rows = png
    return sum(all(abs(row[x * bpp + k] - colour[k]) <= tolerance for k in range(3)) for row in rows for x in range(width))


def test_dashboard_draws_the_pool_split(server, tmp_path):
    traffic(server.url)
    memory = server.memory()
    assert max(memory["series"]["kv_pages"]) > 0 and memory["current"]["expert_pages"] > 0

    dom = chromium(tmp_path, "--dump-dom", f"{server.url}/dashboard").decode()
    assert 'id="pool"' in dom and "cannot read" not in dom
    samples = int(dom.split('data-samples="', 1)[1].split('"', 1)[0])
    assert samples > 10
    pool = dom[dom.index('id="pool"') - 300 : dom.index('id="pool"') + 300]
    points = int(pool.split('data-points="', 1)[1].split('"', 1)[0])
    expert_max, kv_max, *_ = map(float, pool.split('data-max="', 1)[1].split('"', 1)[0].split())
    assert points > 10 and expert_max > 0 and kv_max > 0

    shot = tmp_path / "dashboard.png"
    chromium(tmp_path, f"--screenshot={shot}", f"{server.url}/dashboard")
    png = read_png(shot)
    assert count_colour(png, KV_BLUE) > 500 and count_colour(png, EXPERT_ORANGE) > 2000
