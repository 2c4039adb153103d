# Source on a GPU machine without an install: lays the four folders out as one `rimuru` package under /tmp/pkg.
# Usage: source tools/device_env.sh   (from the repository root)
rm -rf /tmp/pkg && mkdir -p /tmp/pkg/rimuru
cp -r rimuru/. /tmp/pkg/rimuru/
for sub in ops models serving; do ln -s "$PWD/$sub" "/tmp/pkg/rimuru/$sub"; done
export PYTHONPATH=/tmp/pkg:$PWD PYTHONUNBUFFERED=1
# Triton's compiled kernels in the repository (git-ignored): carry `.triton-cache` into a device call and the
# kernels compiled by an earlier call load instead of compiling again (`device_session.sh cache` returns them)
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}
