# Source on a GPU machine without an install: lays the four folders out as one `rimuru` package under /tmp/pkg.
# Usage: source tools/device_env.sh   (from the repository root)
rm -rf /tmp/pkg && mkdir -p /tmp/pkg/rimuru
cp -r rimuru/. /tmp/pkg/rimuru/
for sub in ops models serving; do ln -s "$PWD/$sub" "/tmp/pkg/rimuru/$sub"; done
export PYTHONPATH=/tmp/pkg:$PWD PYTHONUNBUFFERED=1
# Triton's compiled kernels from an earlier call load instead of compiling again: `device_session.sh cache` returns
# them as triton-cache.tar.gz in parts of 15 MB (the fetch limit is 16 MiB a file); put the parts in `.bench`
# (carried; the unpacked cache outgrew the 64 MiB carry limit). A single triton-cache.tar.gz works too.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}
if compgen -G ".bench/triton-cache.tar.gz.part-*" > /dev/null; then
  mkdir -p "$TRITON_CACHE_DIR" && cat .bench/triton-cache.tar.gz.part-* | tar -xz -C "$TRITON_CACHE_DIR"
elif [ -f .bench/triton-cache.tar.gz ]; then
  mkdir -p "$TRITON_CACHE_DIR" && tar -xzf .bench/triton-cache.tar.gz -C "$TRITON_CACHE_DIR"
fi
