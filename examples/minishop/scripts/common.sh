# What the saga scripts (saga-figures.sh, saga-stages.sh, saga-cpu.sh)
# share: the minishop binary and the servers' URLs, each overridable from
# the environment, and the check that the binary is built. Sourced, not run.
BIN=${BIN:-target/release/minishop}
PG=${PG:-postgres://postgres@127.0.0.1:5432/test}
AMQP=${AMQP:-amqp://guest:guest@127.0.0.1:5672/%2f}
[ -x "$BIN" ] || { echo "no minishop binary at $BIN: cargo build --release -p minishop"; exit 2; }
