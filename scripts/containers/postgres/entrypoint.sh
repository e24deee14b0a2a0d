#!/bin/sh
# Initialises a cluster on first start, as the official image does, then
# runs the server in the foreground as the container's first process (its
# log on standard error). Arguments are the server's, as with the official
# image: `postgres -c fsync=on …` (a leading `postgres` is the server itself).
set -eu
bin=/usr/lib/postgresql/15/bin
user=${POSTGRES_USER:-postgres}
db=${POSTGRES_DB:-$user}
auth=${POSTGRES_HOST_AUTH_METHOD:-scram-sha-256}
mkdir -p "$PGDATA" /var/run/postgresql
chown -R postgres:postgres "$PGDATA" /var/run/postgresql
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile=$(mktemp)
  printf '%s\n' "${POSTGRES_PASSWORD:-postgres}" >"$pwfile"
  chown postgres "$pwfile"
  su postgres -c "$bin/initdb -D '$PGDATA' -U '$user' --pwfile='$pwfile' -A trust >/dev/null"
  rm -f "$pwfile"
  echo "host all all all $auth" >>"$PGDATA/pg_hba.conf"
  echo "listen_addresses = '*'" >>"$PGDATA/postgresql.auto.conf"
  if [ "$db" != postgres ]; then
    su postgres -c "$bin/postgres --single -D '$PGDATA' postgres" <<SQL >/dev/null
CREATE DATABASE "$db" OWNER "$user";
SQL
  fi
fi
if [ "${1:-}" = postgres ]; then shift; fi
exec setpriv --reuid=postgres --regid=postgres --init-groups "$bin/postgres" -D "$PGDATA" -p "$PGPORT" "$@"
