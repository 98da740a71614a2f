#!/usr/bin/env bash
# A real S3-compatible server on 127.0.0.1 for the tests: Ceph radosgw (Debian's ceph 16)
# over one monitor and one memstore OSD, auth none. ~15 s to start.
#
#   scripts/s3-server.sh install   apt-get the packages (CI does this)
#   scripts/s3-server.sh start     start it; prints the environment to export
#   scripts/s3-server.sh stop      stop it and remove its data
#
# State lives in $ZS_S3_DIR (default /tmp/zerostall-s3). Port: $ZS_S3_PORT (default 7480).
# The S3 endpoint listens on $ZS_S3_HOST (default 127.0.0.1; the monitor and OSD stay on
# loopback): run inside a network namespace with ZS_S3_HOST=<its address> to serve other
# namespaces (tests/cluster/nodeloss_links.py does).
set -euo pipefail
DIR=${ZS_S3_DIR:-/tmp/zerostall-s3}
PORT=${ZS_S3_PORT:-7480}
HOST=${ZS_S3_HOST:-127.0.0.1}
MONPORT=${ZS_S3_MONPORT:-6790}
ACCESS=zerostall-test
SECRET=zerostall-test-secret
CONF=$DIR/ceph.conf

install() {
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends ceph-mon ceph-osd radosgw ceph-common >/dev/null
}

start() {
  command -v ceph-mon >/dev/null || { echo "ceph-mon not installed: run $0 install" >&2; exit 2; }
  stop >/dev/null 2>&1 || true
  mkdir -p "$DIR"/{mon,osd,run,log}
  FSID=$(python3 -c 'import uuid; print(uuid.uuid4())')
  cat > "$CONF" <<CONF
[global]
fsid = $FSID
mon host = [v2:127.0.0.1:$MONPORT]
mon initial members = a
auth cluster required = none
auth service required = none
auth client required = none
ms mon client mode = crc
ms client mode = crc
ms cluster mode = crc
ms service mode = crc
ms bind ipv4 = true
ms bind ipv6 = false
public addr = 127.0.0.1
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd crush chooseleaf type = 0
mon allow pool size one = true
mon warn on pool no redundancy = false
mon data avail warn = 1
mon data avail crit = 0
auth allow insecure global id reclaim = true
mon max pg per osd = 1000
osd objectstore = memstore
memstore device bytes = 4294967296
run dir = $DIR/run
log file = $DIR/log/\$name.log
admin socket = $DIR/run/\$name.asok
[mon.a]
mon data = $DIR/mon
[osd.0]
osd data = $DIR/osd
[client.rgw.zs]
rgw frontends = beast endpoint=$HOST:$PORT
rgw data = $DIR/rgw
rgw dns name = $HOST
CONF
  monmaptool --create --addv a "[v2:127.0.0.1:$MONPORT]" --fsid "$FSID" "$DIR/monmap" >/dev/null
  ceph-authtool --create-keyring "$DIR/keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
  ceph-mon -c "$CONF" --mkfs -i a --monmap "$DIR/monmap" --keyring "$DIR/keyring"
  ceph-mon -c "$CONF" -i a
  for _ in $(seq 60); do timeout 5 ceph -c "$CONF" -s >/dev/null 2>&1 && break; sleep 0.5; done
  OSD=$(timeout 30 ceph -c "$CONF" osd create)
  ceph-osd -c "$CONF" -i "$OSD" --mkfs >/dev/null 2>&1
  ceph-osd -c "$CONF" -i "$OSD"
  for _ in $(seq 120); do timeout 5 ceph -c "$CONF" osd stat 2>/dev/null | grep -q "1 up" && break; sleep 0.5; done
  mkdir -p "$DIR/rgw"
  radosgw -c "$CONF" -n client.rgw.zs
  for _ in $(seq 120); do curl -s -o /dev/null "http://$HOST:$PORT" && break; sleep 0.5; done
  timeout 60 radosgw-admin -c "$CONF" user create --uid=zerostall --display-name=zerostall \
    --access-key=$ACCESS --secret-key=$SECRET >/dev/null 2>&1 || true
  env_out
}

env_out() {
  echo "export AWS_ENDPOINT_URL=http://$HOST:$PORT"
  echo "export AWS_ACCESS_KEY_ID=$ACCESS"
  echo "export AWS_SECRET_ACCESS_KEY=$SECRET"
  echo "export AWS_DEFAULT_REGION=us-east-1"
  echo "export ZEROSTALL_TEST_S3=1"
}

stop() {
  pkill -f "radosgw -c $CONF" 2>/dev/null || true
  pkill -f "ceph-osd -c $CONF" 2>/dev/null || true
  pkill -f "ceph-mon -c $CONF" 2>/dev/null || true
  sleep 1
  rm -rf "$DIR"
}

case "${1:-}" in
  install) install ;;
  start) start ;;
  stop) stop ;;
  env) env_out ;;
  *) echo "usage: $0 install|start|stop|env" >&2; exit 2 ;;
esac
