#!/bin/sh
# A WebSocket echo server in busybox ash, one connection per run (nc -ll -e runs it):
# the RFC 6455 handshake, then every text/binary message is sent back, pings get pongs,
# and a close is answered with the same close code.
cr=$(printf '\r')
key=
while read -r line; do
    line=${line%"$cr"}
    [ -z "$line" ] && break
    case "$line" in
        [Ss]ec-[Ww]eb[Ss]ocket-[Kk]ey:*) key=${line#*:}; key=${key# } ;;
    esac
done
[ -n "$key" ] || exit 1
hex=$(printf '%s' "${key}258EAFA5-E914-47DA-95CA-C5AB0DC85B11" | sha1sum | cut -c1-40)
accept=$(printf "$(echo "$hex" | sed 's/../\\x&/g')" | base64)
printf 'HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n'
printf 'Sec-WebSocket-Accept: %s\r\n\r\n' "$accept"

bytes() { dd bs=1 count="$1" 2>/dev/null | od -An -v -tu1; }

# send OPCODE BYTE... : one unmasked final frame (payloads below 64 KiB)
send() {
    op=$1; shift
    if [ $# -lt 126 ]; then head="$((128 | op)) $#"
    else head="$((128 | op)) 126 $(($# >> 8)) $(($# & 255))"; fi
    printf "$(printf '\\%03o' $head "$@")"
}

while :; do
    set -- $(bytes 2)
    [ $# -eq 2 ] || exit 0
    op=$(($1 & 15)); len=$(($2 & 127))
    if [ "$len" -eq 126 ]; then set -- $(bytes 2); len=$(($1 * 256 + $2)); fi
    set -- $(bytes 4); m0=$1 m1=$2 m2=$3 m3=$4
    payload= i=0
    for b in $(bytes "$len"); do
        case $((i % 4)) in 0) m=$m0 ;; 1) m=$m1 ;; 2) m=$m2 ;; *) m=$m3 ;; esac
        payload="$payload $((b ^ m))"; i=$((i + 1))
    done
    case $op in
        8) send 8 $payload; exit 0 ;;
        9) send 10 $payload ;;
        10) ;;
        *) send "$op" $payload ;;
    esac
done
