/* seen: what the daemon knows of each delta file a transport lists (keyed by its Hub path), so a
 * file is taken in once per version, a bad one is reported once, and a growing one is retried. */
#ifndef SEEN_H
#define SEEN_H

#include <stddef.h>
#include <stdint.h>

typedef enum seen_state {
    SEEN_PENDING,       /* queued or being taken in */
    SEEN_DONE,          /* accepted, stale, duplicate, ...: nothing more to do for this version */
    SEEN_REJECTED,      /* invalid: reported once */
    SEEN_INCOMPLETE,    /* being written: retried while it changes */
} seen_state;

typedef struct seen_entry {
    char *key;
    uint64_t size;
    int64_t mtime_ns;
    uint64_t ino;
    seen_state state;
    double since;       /* when this version was first seen */
    uint64_t listed;    /* the last scan that listed it (seen_prune) */
} seen_entry;

/* Open addressing over keys that workers choose (file names under nodes/): the hash is keyed with a
 * random seed drawn when the map first grows, so nobody can aim names at one probe chain and make every
 * lookup walk it (an unkeyed hash could be flooded from the listing).  A zeroed map is empty and valid. */
typedef struct seen_map {
    seen_entry *slots;
    size_t cap, count;
    uint64_t seed;
} seen_map;

/* Finds key, or inserts it (state SEEN_PENDING, identity zero).  NULL on allocation failure. */
seen_entry *seen_get(seen_map *m, const char *key, int *created);
seen_entry *seen_find(const seen_map *m, const char *key);
/* Removes the entries keep() says no to (a file no longer listed is forgotten: the map follows the
 * tree instead of growing with every file it ever held).  0, or -1 when out of memory (nothing
 * removed). */
int seen_prune(seen_map *m, int (*keep)(const seen_entry *e, void *arg), void *arg);
void seen_free(seen_map *m);

#endif
