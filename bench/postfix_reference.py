"""The reference point of the end-to-end targets, measured on this host: Postfix relaying the e2e load.

    smtp-source (20 sessions, 5 KB) --SMTP--> a private Postfix instance (its own config, seen as
        /etc/postfix in a mount namespace, and queue directory, both temporary; 127.0.0.1 only) --SMTP (relayhost)--> smtp-sink

The end-to-end targets are multiples of Postfix's figure on "this machine kind" (about 670 msgs/s
end to end without DKIM); hosts of the kind differ by a factor of three (bench/README.md "Hosts"),
so a figure of pigeon-mta means something only beside Postfix's on the same host, in interleaved
runs. Postfix runs with its stock settings except for what relaying here needs (relayhost,
mynetworks, no TLS, no chroot, its own queue directory); its queue files are fsynced as always. Reported: the
accept rate (until smtp-source finished) and the end-to-end rate (until the queue was empty),
and CPU per component. Needs postfix (`apt-get install postfix`) and root (Postfix starts as root
and drops to its mail_owner). Bounded: --messages, and --timeout for the whole run. The instance
is stopped (`postfix stop`) and its directory removed at the end.

    .venv/bin/python bench/postfix_reference.py [--messages 20000] [--dkim rsa|none] [--dump]

With --dkim rsa, OpenDKIM (`apt-get install opendkim`) signs as a milter with a new RSA-2048 key,
relaxed/relaxed, its configuration in a private directory under /run (it refuses one under /tmp),
listening on a UNIX socket there (as Debian's package sets it up). Over a TCP socket on loopback
the milter conversation stalls on Nagle/delayed ACKs: measured on one host, 214 msgs/s with 0.7
of 2 cores busy, against 373 msgs/s and both cores busy over the UNIX socket.
--dump keeps the sink's copies and counts the ones that carry a DKIM-Signature (for a small run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e import children, cpu_seconds, free_port, machine_cpu


def tool(name: str, package: str = "postfix") -> str:
    found = shutil.which(name) or (
        f"/usr/sbin/{name}" if Path(f"/usr/sbin/{name}").exists() else None
    )
    if found is None:
        sys.exit(f"{name} is missing: apt-get install {package}")
    return found


def run_postfix(postfix: str, conf: Path, command: str, *, check: bool = True) -> None:
    """`postfix COMMAND` as the default instance of a private mount namespace whose /etc/postfix
    is `conf`: Postfix refuses `-c DIR` for a directory the host's own main.cf does not list, and
    this leaves the host's configuration alone. The master it starts stays in that namespace."""
    subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            f'mount --bind "{conf}" /etc/postfix && exec "{postfix}" {command}',
        ],
        check=check,
        timeout=60,
    )


def queued_files(spool: Path) -> int:
    """Messages still in Postfix's queue: files under incoming, active, deferred, hold, maildrop."""
    return sum(
        1
        for sub in ("maildrop", "incoming", "active", "deferred", "hold")
        for _root, _dirs, files in os.walk(spool / sub)
        for _f in files
    )


def descendants(pid: int) -> list[int]:
    """pid and every process below it (this instance's master and its daemons, not the host's)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children(p))
    return found


def wait_for_listener(
    address: tuple[str, int] | Path, seconds: float, alive: Callable[[], bool]
) -> None:
    """Until something accepts a connection at `address` (TCP host and port, or a UNIX socket
    path); exits if `alive` says the process that should listen died, or after `seconds`."""
    family = socket.AF_UNIX if isinstance(address, Path) else socket.AF_INET
    target = str(address) if isinstance(address, Path) else address
    deadline = time.monotonic() + seconds
    while True:
        try:
            with socket.socket(family) as probe:
                probe.settimeout(1)
                probe.connect(target)
            return
        except OSError:
            if time.monotonic() > deadline or not alive():
                raise SystemExit(f"nothing listens on {address}") from None
            time.sleep(0.1)


def stop(process: subprocess.Popen[bytes] | None) -> None:
    if process is not None and process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--size", type=int, default=5120)
    parser.add_argument("--timeout", type=float, default=600, help="the run gives up after this")
    parser.add_argument(
        "--dkim",
        choices=["rsa", "none"],
        default="none",
        help="rsa: sign with OpenDKIM as a milter (RSA-2048), the DKIM target's reference",
    )
    parser.add_argument("--keep", action="store_true", help="keep the instance's directory")
    parser.add_argument(
        "--dump", action="store_true", help="keep the sink's messages (for a check of a small run)"
    )
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("Postfix's master starts as root: run this as root")
    postfix, source, sink_cmd = tool("postfix"), tool("smtp-source"), tool("smtp-sink")
    postconf = tool("postconf")
    opendkim_cmd = tool("opendkim", "opendkim") if args.dkim == "rsa" else ""
    genkey = tool("opendkim-genkey", "opendkim-tools") if args.dkim == "rsa" else ""
    load_command = [
        *(source, "-d", "-s", str(args.sessions), "-l", str(args.size), "-m", str(args.messages)),
        *("-f", "sender@bench.test", "-t", "rcpt@sink.test"),
    ]

    work = Path(tempfile.mkdtemp(prefix="pigeon-postfix-ref-"))
    secure: Path | None = None
    sink = opendkim = load = None
    results: dict[str, object] = {}
    try:
        work.chmod(0o755)  # Postfix's daemons run as its mail_owner and must reach their dirs
        conf, spool, data = work / "etc", work / "spool", work / "data"
        shutil.copytree("/etc/postfix", conf)  # postfix-files, dynamicmaps.cf, ...; main.cf below
        spool.mkdir()
        data.mkdir()
        shutil.chown(data, "postfix", "postfix")
        smtp_port, sink_port = free_port(), free_port()
        milter = ""
        if args.dkim == "rsa":
            # OpenDKIM refuses a configuration or key under a directory others may write (/tmp).
            secure = Path(tempfile.mkdtemp(prefix="pigeon-postfix-ref-", dir="/run"))
            secure.chmod(0o755)
            sockets = secure / "sock"  # opendkim's, readable by Postfix's smtpd
            sockets.mkdir(mode=0o755)
            shutil.chown(sockets, "opendkim", "opendkim")
            keys = secure / "keys"
            keys.mkdir()
            subprocess.run(
                [genkey, "-b", "2048", "-d", "bench.test", "-s", "b1", "-D", str(keys)],
                check=True,
                timeout=60,
            )
            shutil.chown(keys / "b1.private", "opendkim", "opendkim")
            (secure / "opendkim.conf").write_text(
                f"""Mode s
Domain bench.test
Selector b1
KeyFile {keys / "b1.private"}
Canonicalization relaxed/relaxed
Socket local:{sockets / "milter"}
UMask 000
UserID opendkim
Syslog no
PidFile {secure / "opendkim.pid"}
"""
            )
            opendkim = subprocess.Popen([opendkim_cmd, "-f", "-x", str(secure / "opendkim.conf")])
            # The milter must listen before Postfix takes mail (else: 451 tempfail).
            wait_for_listener(
                sockets / "milter", 15, lambda: opendkim is not None and opendkim.poll() is None
            )
            milter = (
                f"smtpd_milters = unix:{sockets / 'milter'}\nmilter_default_action = tempfail\n"
            )
        (conf / "main.cf").write_text(
            f"""compatibility_level = 3.6
queue_directory = {spool}
data_directory = {data}
myhostname = bench.test
mydestination =
inet_interfaces = 127.0.0.1
inet_protocols = ipv4
mynetworks = 127.0.0.0/8
relayhost = [127.0.0.2]:{sink_port}
smtpd_tls_security_level = none
smtp_tls_security_level = none
smtpd_relay_restrictions = permit_mynetworks, reject
maillog_file = {work}/maillog
maillog_file_prefixes = {work}
alias_maps =
alias_database =
{milter}"""
        )
        # The SMTP listener on a free loopback port; no chroot (the queue is not under /var/spool).
        rewritten = []
        for line in (conf / "master.cf").read_text().splitlines():
            if re.match(r"^smtp\s+inet\s", line):
                line = re.sub(r"^smtp\s+inet", f"127.0.0.1:{smtp_port} inet", line)
            fields = line.split()
            if len(fields) >= 8 and not line.startswith((" ", "\t", "#")) and fields[4] == "y":
                fields[4] = "n"
                line = "  ".join(fields)
            rewritten.append(line)
        (conf / "master.cf").write_text("\n".join(rewritten) + "\n")

        dump = ["-d", f"{work}/sink/%M."] if args.dump else []
        if args.dump:
            (work / "sink").mkdir()
            shutil.chown(work / "sink", "nobody")
        sink = subprocess.Popen(
            [sink_cmd, "-u", "nobody", *dump, f"127.0.0.2:{sink_port}", "1000"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        run_postfix(postfix, conf, "check")
        run_postfix(postfix, conf, "start")
        master = int((spool / "pid" / "master.pid").read_text().split()[0])
        wait_for_listener(("127.0.0.1", smtp_port), 15, lambda: Path(f"/proc/{master}").exists())
        before = {p: cpu_seconds(p) for p in descendants(master)}
        dkim_before = cpu_seconds(opendkim.pid) if opendkim is not None else 0.0
        machine_start = machine_cpu()
        began = time.monotonic()
        load_log = open(work / "smtp-source.err", "wb")
        load = subprocess.Popen(
            [*load_command, f"127.0.0.1:{smtp_port}"],
            stdout=subprocess.DEVNULL,
            stderr=load_log,
        )
        accepted_at = None
        postfix_cpu: dict[int, float] = {}
        while time.monotonic() - began < args.timeout:
            time.sleep(0.25)
            # Postfix's daemons come and go (max_idle); keep the last reading of each.
            for pid in descendants(master):
                postfix_cpu[pid] = cpu_seconds(pid) - before.get(pid, 0.0)
            if accepted_at is None and load.poll() is not None:
                accepted_at = time.monotonic()
            if accepted_at is not None and queued_files(spool) == 0:
                break
        finished = time.monotonic()
        wall = finished - began
        busy = machine_cpu()[0] - machine_start[0]
        stop(load)
        load_log.close()
        log = (work / "maillog").read_text(errors="replace") if (work / "maillog").exists() else ""
        sent = log.count("status=sent")
        results = {
            "postfix": subprocess.run(
                [postconf, "-c", str(conf), "-h", "mail_version"],
                capture_output=True,
                text=True,
                check=False,
            ).stdout.strip(),
            "messages_offered": args.messages,
            "delivered (status=sent in its log)": sent,
            "left in its queue": queued_files(spool),
            "accept_rate": round(args.messages / ((accepted_at or finished) - began), 1),
            "e2e_rate": round(sent / wall, 1),
            "wall_s": round(wall, 1),
            "timed_out": accepted_at is None or queued_files(spool) > 0,
            "postfix_cores_busy": round(sum(postfix_cpu.values()) / wall, 2),
            "machine_cores_busy": round(busy / wall, 2),
            "load_stderr": (work / "smtp-source.err").read_text(errors="replace")[-300:],
        }
        if opendkim is not None:
            results["opendkim_cores_busy"] = round(
                (cpu_seconds(opendkim.pid) - dkim_before) / wall, 2
            )
        if args.dump:
            dumped = [f.read_bytes() for f in (work / "sink").rglob("*") if f.is_file()]
            results["sink_messages_with_DKIM-Signature"] = sum(
                b"DKIM-Signature: v=1" in m for m in dumped
            )
            results["sink_messages"] = len(dumped)
    finally:
        stop(load)
        if (work / "spool" / "pid" / "master.pid").exists():
            run_postfix(postfix, work / "etc", "stop", check=False)
        stop(sink)
        stop(opendkim)
        if secure is not None:
            shutil.rmtree(secure, ignore_errors=True)
        time.sleep(1)  # the master's daemons exit after it
        if args.keep:
            print(f"kept {work} (its maillog says what Postfix did)", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(
        f"# postfix_reference {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, "
        f"{platform.node()}, {os.cpu_count()} cores, dkim={args.dkim}, {args.size} B messages, "
        f"{args.sessions} sessions"
    )
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
