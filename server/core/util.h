/* util: the few definitions every server file shares. */
#ifndef SERVER_UTIL_H
#define SERVER_UTIL_H

#include <stddef.h>

#ifndef DILOCOD_VERSION
#define DILOCOD_VERSION "0.1.0"
#endif

/* The struct that embeds member (libuv handles, llhttp parsers): never a first-member cast. */
#define container_of(ptr, type, member) ((type *)((char *)(ptr) - offsetof(type, member)))

#define COUNT_OF(a) (sizeof(a) / sizeof((a)[0]))

#endif
