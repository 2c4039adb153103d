# Source on a GPU machine without an install: lays the four folders out as one `rimuru` package under /tmp/pkg.
# Usage: source tools/device_env.sh   (from the repository root)
rm -rf /tmp/pkg && mkdir -p /tmp/pkg/rimuru
cp -r rimuru/. /tmp/pkg/rimuru/
for sub in ops models serving; do ln -s "$PWD/$sub" "/tmp/pkg/rimuru/$sub"; done
export PYTHONPATH=/tmp/pkg:$PWD PYTHONUNBUFFERED=1
