/* sign: the Ed25519 keys of verifiable rounds (README "Verifiable rounds"), on OpenSSL's libcrypto.
 *
 * A private key is a PEM PKCS#8 file that only its owner may read (mode & 077 == 0, as ssh holds its
 * keys); a public key is a PEM SubjectPublicKeyInfo file.  A key's fingerprint is the sha256 of its 32
 * raw public-key bytes, in lowercase hex.  A signature is the 64 raw bytes of Ed25519 (RFC 8032, pure:
 * the message itself is signed, not a digest of it). */
#ifndef SIGN_H
#define SIGN_H

#include <stddef.h>

#include "dl_error.h"

#define SIGN_BYTES 64
#define SIGN_PUB_BYTES 32
#define SIGN_FINGERPRINT_HEX 65         /* 64 hex digits and the NUL */
#define SIGN_KEY_FILE_MAX (64 * 1024)   /* a PEM key is a few hundred bytes: anything larger is not one */

typedef struct sign_key {
    void *pkey;                 /* EVP_PKEY (kept opaque: the header does not pull in OpenSSL's) */
    int private_key;            /* 1: it can sign */
    unsigned char pub[SIGN_PUB_BYTES];
    char fingerprint[SIGN_FINGERPRINT_HEX];
} sign_key;

/* 0 when the open file fd (what: "signing key", "token file"; path for the message) is a regular file
 * no one but its owner can read or write; else -DL_E_INVALID_ARGUMENT saying which mode to set. */
int sign_check_private_fd(int fd, const char *what, const char *path, dl_error *err);
/* Loads an Ed25519 private key (PEM PKCS#8), its mode checked as above.  An encrypted key is refused
 * (a daemon has no one to ask for its passphrase). */
int sign_key_load(sign_key *k, const char *path, dl_error *err);
/* Loads an Ed25519 public key (PEM SubjectPublicKeyInfo; a private key file gives its public half). */
int sign_pub_load(sign_key *k, const char *path, dl_error *err);
void sign_key_free(sign_key *k);
/* Writes a new key pair: path (PKCS#8, mode 0600) and path.pub (SPKI, mode 0644).  Neither may exist:
 * nothing is overwritten.  fingerprint receives the new key's. */
int sign_keygen(const char *path, char fingerprint[SIGN_FINGERPRINT_HEX], dl_error *err);
/* sig = Ed25519(k, msg).  k must be a private key. */
int sign_message(const sign_key *k, const void *msg, size_t len, unsigned char sig[SIGN_BYTES], dl_error *err);
/* 1 when sig is k's signature of msg, else 0. */
int sign_verify(const sign_key *k, const void *msg, size_t len, const unsigned char sig[SIGN_BYTES]);

#endif
