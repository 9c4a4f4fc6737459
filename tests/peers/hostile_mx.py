"""A hostile MX on loopback: RCPT to one of the local parts of REPLIES is answered with that reply
(other scripts' digits in the enhanced code, 32 KB of lines, Latin-1 bytes and a NUL), every
other RCPT with 250, and the final dot with 250; what it took is appended to `delivered`.

    engine --SMTP--> HostileMx 127.0.0.x:<port>
"""

from __future__ import annotations

import asyncio

# RCPT replies by local part: the middle digit of the first is U+0661 ARABIC-INDIC DIGIT ONE.
REPLIES = {
    b"poison-digit": "550 5.\u0661.1 User unknown".encode(),
    b"poison-digit-temp": "450 4.\u0661.1 try later".encode(),
    # 30 lines of 1,000 octets, as much as aiosmtplib reads of one reply (32 KB).
    b"poison-long": b"".join(b"550-5.1.1 " + b"exceeded " * 110 + b"\r\n" for _ in range(29))
    + b"550 5.1.1 "
    + b"y" * 990,
    # Not UTF-8, and a NUL, which PostgreSQL's text refuses.
    b"latin1": b"550 5.1.1 Empf\xe4nger unbekannt\x00 (user unknown)",
}


async def hostile_server(host: str, port: int, delivered: list[bytes]) -> asyncio.Server:
    async def session(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"220 hostile.test ESMTP\r\n")
        recipients: list[bytes] = []
        while line := await reader.readline():
            verb = line[:4].upper()
            if verb in (b"EHLO", b"HELO"):
                writer.write(b"250-hostile.test\r\n250 SMTPUTF8\r\n")
            elif verb == b"RCPT":
                local = line.split(b"<", 1)[1].split(b"@", 1)[0]
                if local in REPLIES:
                    writer.write(REPLIES[local] + b"\r\n")
                else:
                    recipients.append(local)
                    writer.write(b"250 2.1.5 ok\r\n")
            elif verb == b"DATA":
                writer.write(b"354 go\r\n")
                await writer.drain()
                while (await reader.readline()) not in (b".\r\n", b""):
                    pass
                delivered.extend(recipients)
                writer.write(b"250 2.0.0 queued\r\n")
            elif verb == b"RSET" or verb == b"MAIL":
                recipients = []
                writer.write(b"250 2.0.0 ok\r\n")
            elif verb == b"QUIT":
                writer.write(b"221 bye\r\n")
                break
            else:
                writer.write(b"250 ok\r\n")
            await writer.drain()
        writer.close()

    return await asyncio.start_server(session, host, port)
