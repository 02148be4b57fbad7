//! The frame protocol over the doorbell socket and the payload path (slots of the ring, or
//! PULLs): [`ShmTransport`]'s side of [`FrameTransport`]. The state it keeps (cursor, slot
//! credits, pulls in flight) and the invariants it keeps are in the module docs of `shm`.

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;

impl FrameTransport for ShmTransport {
    async fn read_idle(&mut self, buf: &mut [u8; HEADER_LEN]) -> Result<()> {
        let n = bounded(self.t.idle, IDLE, self.sock.read(&mut buf[..1])).await?;
        if n == 0 {
            return Err(Error::PeerClosed { during: IDLE });
        }
        self.read_ctl(&mut buf[1..], "reading a frame header").await
    }

    async fn read_ctl(&mut self, buf: &mut [u8], during: &'static str) -> Result<()> {
        if self.cursor.loaded {
            return Err(Error::malformed(
                "PULL",
                "regions extend past the layer payload",
            ));
        }
        if self.rx_rem != 0 {
            return Err(Error::malformed(
                "CHUNK",
                "chunk extends past the layer payload",
            ));
        }
        self.sock_read(buf, during).await
    }

    async fn begin_payload(&mut self, len: u64) -> Result<()> {
        self.layer_left = len;
        Ok(())
    }

    async fn read_payload_vectored(&mut self, bufs: &mut [&mut [u8]]) -> Result<()> {
        if self.mode == ShmMode::Pull {
            return self.pull_payload(bufs).await;
        }
        for b in bufs.iter_mut() {
            self.read_payload(b).await?;
        }
        Ok(())
    }

    async fn read_payload(&mut self, dst: &mut [u8]) -> Result<()> {
        if self.mode == ShmMode::Pull {
            return self.pull_payload(&mut [dst]).await;
        }
        let mut filled = 0;
        while filled < dst.len() {
            if self.rx_rem == 0 {
                let mut hdr = [0u8; HEADER_LEN];
                self.sock_read(&mut hdr, "waiting for a shm doorbell")
                    .await?;
                let h = FrameHeader::decode(&hdr)?;
                if h.tag != TAG_CHUNK {
                    return Err(Error::UnexpectedFrame {
                        expected: "CHUNK",
                        tag: h.tag,
                    });
                }
                if h.mac() || h.arg != self.slot_of(self.rx_seq) {
                    return Err(Error::malformed("CHUNK", "wrong slot or flags"));
                }
                if h.len == 0 || h.len > self.slot_bytes as u64 {
                    return Err(Error::Oversized {
                        what: "shm chunk",
                        len: h.len,
                        limit: self.slot_bytes as u64,
                    });
                }
                self.rx_slot = h.arg;
                self.rx_off = 0;
                self.rx_rem = h.len as usize;
            }
            let n = self.rx_rem.min(dst.len() - filled);
            let at = self.rx_slot as usize * self.slot_bytes + self.rx_off;
            self.map.read_at(at, &mut dst[filled..filled + n])?;
            filled += n;
            self.rx_off += n;
            self.rx_rem -= n;
            if self.rx_rem == 0 {
                let credit = FrameHeader::new(TAG_CREDIT, false, self.rx_slot, 0).encode();
                self.sock_write(&credit, "returning a shm slot").await?;
                self.rx_seq += 1;
            }
        }
        Ok(())
    }

    async fn write_ctl(&mut self, buf: &[u8], during: &'static str) -> Result<()> {
        self.sock_write(buf, during).await
    }

    async fn write_layer<R: AsRef<[u8]> + Sync>(
        &mut self,
        header: &[u8; HEADER_LEN],
        k: &[R],
        v: &[R],
        trailer: Option<[u8; MAC_LEN]>,
    ) -> Result<()> {
        if self.mode == ShmMode::Pull {
            return self.pull_layer(header, k, v, trailer).await;
        }
        self.sock_write(header, "sending a layer header").await?;
        let mut fill = 0usize;
        for region in k.iter().chain(v) {
            let mut src = region.as_ref();
            while !src.is_empty() {
                if fill == 0 {
                    self.wait_slot().await?;
                }
                let n = (self.slot_bytes - fill).min(src.len());
                let at = self.slot_of(self.tx_seq) as usize * self.slot_bytes + fill;
                self.map.write_at(at, &src[..n])?;
                fill += n;
                src = &src[n..];
                if fill == self.slot_bytes {
                    self.ring(fill).await?;
                    fill = 0;
                }
            }
        }
        if fill > 0 {
            self.ring(fill).await?;
        }
        if let Some(t) = trailer {
            self.sock_write(&t, "sending a MAC trailer").await?;
        }
        Ok(())
    }

    async fn write_layer_owned(
        &mut self,
        header: &[u8; HEADER_LEN],
        k: Vec<Bytes>,
        v: Vec<Bytes>,
        trailer: Option<[u8; MAC_LEN]>,
    ) -> Result<()> {
        if self.mode != ShmMode::Pull {
            return self.write_layer(header, &k, &v, trailer).await;
        }
        // Owned regions stay alive in `in_flight` until their PULLED: the next layer goes
        // out while the receiver still copies this one.
        if let Some(pull) = self.send_pull(header, &k, &v, trailer).await? {
            pull._regions = Some((k, v));
        }
        self.wait_pulled(MAX_PULLS_IN_FLIGHT).await
    }

    fn transfer_ended(&mut self) -> Result<()> {
        if self.in_flight.is_empty() {
            Ok(())
        } else {
            Err(Error::malformed(
                "VERDICT",
                "success while layers were still being pulled",
            ))
        }
    }

    async fn read_reply_header(&mut self, buf: &mut [u8; HEADER_LEN]) -> Result<()> {
        loop {
            self.sock_read(buf, "waiting for the verdict").await?;
            let h = FrameHeader::decode(buf)?;
            match h.tag {
                TAG_CREDIT => self.take_credit(&h)?,
                TAG_PULLED => self.take_pulled(&h)?,
                _ => return Ok(()),
            }
        }
    }

    async fn poll_early_reply(&mut self, _buf: &mut [u8; HEADER_LEN]) -> Result<bool> {
        // Early rejections surface while waiting for slot credits.
        Ok(false)
    }

    async fn shutdown_and_drain(&mut self) {
        let _ = self.sock.shutdown().await;
        let mut scratch = [0u8; 4096];
        let sock = &mut self.sock;
        let _ = tokio::time::timeout(self.t.drain, async move {
            while let Ok(n) = sock.read(&mut scratch).await {
                if n == 0 {
                    break;
                }
            }
        })
        .await;
    }
}
