#!/bin/sh
# Initialises a data directory on first start, as the official image does
# (root's password and host, the database: statements the server runs at
# each start), then runs the server in the foreground as the container's
# first process, its log on standard error.
# Arguments are the server's options, as with the official image; a leading
# `mariadbd` (or `mysqld`) is the server itself.
set -eu
data=${MARIADB_DATA:-/var/lib/mysql}
mkdir -p "$data" /run/mysqld
chown -R mysql:mysql "$data" /run/mysqld
if [ "${1:-}" = mariadbd ] || [ "${1:-}" = mysqld ]; then shift; fi
if [ ! -d "$data/mysql" ]; then
  mariadb-install-db --user=mysql --datadir="$data" --skip-test-db \
    --auth-root-authentication-method=normal >/dev/null
  host=${MARIADB_ROOT_HOST:-%}
  if [ -n "${MARIADB_ROOT_PASSWORD:-}" ]; then
    auth="IDENTIFIED BY '$(printf '%s' "$MARIADB_ROOT_PASSWORD" | sed "s/'/''/g")'"
  elif [ "${MARIADB_ALLOW_EMPTY_ROOT_PASSWORD:-}" = 1 ] || [ "${MARIADB_ALLOW_EMPTY_ROOT_PASSWORD:-}" = yes ]; then
    auth=""
  else
    echo "entrypoint: set MARIADB_ROOT_PASSWORD or MARIADB_ALLOW_EMPTY_ROOT_PASSWORD=1" >&2
    exit 1
  fi
  # Run by the server at every start, before it takes connections
  # (--init-file: the grant tables are loaded, unlike bootstrap mode);
  # each statement is idempotent.
  init="$data/outbox-init.sql"
  {
    echo "CREATE USER IF NOT EXISTS 'root'@'$host' $auth;"
    echo "GRANT ALL ON *.* TO 'root'@'$host' WITH GRANT OPTION;"
    if [ -n "$auth" ]; then echo "ALTER USER 'root'@'localhost' $auth;"; fi
    if [ -n "${MARIADB_DATABASE:-}" ]; then
      echo "CREATE DATABASE IF NOT EXISTS \`$MARIADB_DATABASE\`;"
    fi
  } >"$init"
  chown mysql "$init"
  chmod 0600 "$init"
fi
# Every address, as the official image (and the PostgreSQL image here:
# listen_addresses = '*'), so that a published port on a bridge network
# reaches it.
exec mariadbd --user=mysql --datadir="$data" --bind-address=0.0.0.0 --init-file="$data/outbox-init.sql" "$@"
